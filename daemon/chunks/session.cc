#include "daemon/chunks/session.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/wire.h"

namespace tierd::daemon {

std::string Session::TokenHex() const {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(token.data()), token.size()));
}

std::string Session::Describe() const {
  return absl::StrCat("session ", id, " (uid ", peer.uid, ", pid ", peer.pid,
                      client_name.empty() ? "" : ", ", client_name, job.empty() ? "" : ", job ",
                      job, ")");
}

absl::Status ValidateJob(absl::string_view job) {
  if (job.size() > static_cast<size_t>(kMaxJobBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("job label of ", job.size(), " bytes; at most ", kMaxJobBytes));
  }
  for (char c : job) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != ':' && c != '/' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("job label '", absl::CHexEscape(job),
                       "' has a character outside letters, digits and \"._:/-\""));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Open(const PeerCredentials& peer,
                                                               absl::string_view client_name,
                                                               absl::string_view job) {
  if (absl::Status s = ValidateJob(job); !s.ok()) return s;
  if (peer.uid >= kFirstBaseOwner) {
    return absl::PermissionDeniedError(absl::StrCat(
        "uid ", peer.uid, " is in the range tierd keeps for shared bases' segments (from ",
        kFirstBaseOwner, "); run the client as another user"));
  }
  auto session = std::make_shared<Session>();
  session->peer = peer;
  session->client_name = std::string(client_name);
  for (char& c : session->client_name) {
    if (c < 0x20 || c > 0x7e) c = '?';  // char may be signed: bytes >= 0x80 are negative
  }
  session->job = std::string(job);
  session->opened = absl::Now();
  size_t filled = 0;
  while (filled < session->token.size()) {
    ssize_t n = getrandom(session->token.data() + filled, session->token.size() - filled, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::ErrnoToStatus(errno, "getrandom for a session token");
    filled += static_cast<size_t>(n);
  }
  absl::MutexLock lock(&mu_);
  const auto counted = per_uid_.find(peer.uid);
  const uint32_t open = counted == per_uid_.end() ? 0 : counted->second;
  if (open >= sessions_per_uid_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", peer.uid, " already has ", open, " sessions open, the most one user may have ",
        "(limits.sessions_per_uid); close some first"));
  }
  if (!job.empty() && !per_job_.contains(job) && per_job_.size() >= kMaxLiveJobs) {
    return absl::ResourceExhaustedError(
        absl::StrCat(per_job_.size(), " jobs have sessions open, the most a node labels at once; ",
                     "join one of them or declare no job"));
  }
  session->id = next_id_++;
  absl::StatusOr<std::unique_ptr<CompletionRing>> ring = CompletionRing::Create(session->id);
  if (!ring.ok()) return ring.status();
  session->completions = std::move(*ring);
  sessions_[session->id] = session;
  ++per_uid_[peer.uid];
  if (!job.empty()) ++per_job_[job];
  return session;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Authenticate(
    absl::string_view credential) const {
  auto denied = [] {
    return absl::PermissionDeniedError(
        absl::StrCat("missing or invalid session credential: open a session on the session "
                     "socket and send '<id>:<token>' in the '",
                     kSessionMetadataKey, "' metadata"));
  };
  size_t colon = credential.find(':');
  SessionId id = 0;
  if (colon == absl::string_view::npos || !absl::SimpleAtoi(credential.substr(0, colon), &id)) {
    return denied();
  }
  absl::string_view hex = credential.substr(colon + 1);
  if (hex.size() != 2 * kSessionTokenBytes ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return denied();
  }
  std::string presented = absl::HexStringToBytes(hex);
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::PermissionDeniedError(
          absl::StrCat("session ", id, " is not open (it ended, or never existed)"));
    }
    session = it->second;
  }
  uint8_t diff = 0;
  for (size_t i = 0; i < session->token.size(); ++i) {
    diff |= static_cast<uint8_t>(presented[i]) ^ session->token[i];
  }
  if (diff != 0) return denied();
  return session;
}

std::shared_ptr<Session> SessionRegistry::Close(SessionId id) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return nullptr;
  std::shared_ptr<Session> session = std::move(it->second);
  sessions_.erase(it);
  if (auto n = per_uid_.find(session->peer.uid); n != per_uid_.end() && --n->second == 0) {
    per_uid_.erase(n);
  }
  if (auto n = per_job_.find(session->job); n != per_job_.end() && --n->second == 0) {
    per_job_.erase(n);
  }
  return session;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  out.reserve(sessions_.size());
  for (const auto& [id, session] : sessions_) out.push_back(session);
  return out;
}

absl::flat_hash_map<uint32_t, uint32_t> SessionRegistry::CountByUid() const {
  absl::MutexLock lock(&mu_);
  return per_uid_;
}

absl::flat_hash_map<std::string, uint32_t> SessionRegistry::CountByJob() const {
  absl::MutexLock lock(&mu_);
  return per_job_;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

}  // namespace tierd::daemon
