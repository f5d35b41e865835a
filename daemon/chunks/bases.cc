#include "daemon/chunks/bases.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/chunks/requests.h"

namespace tierd::daemon {

absl::Status ValidateBaseName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxBaseNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a base name must be 1 to ", kMaxBaseNameBytes, " bytes, not ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' && c != '/' && c != '@' &&
        c != ':') {
      return absl::InvalidArgumentError(
          "a base name is letters, digits and \"._-/@:\" (e.g. \"llama-3-8b@main\")");
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty()) {
      return absl::InvalidArgumentError("a base name has no empty path component");
    }
  }
  return absl::OkStatus();
}

bool InGroup(const PeerCredentials& peer, uint32_t gid) {
  return peer.gid == gid ||
         std::find(peer.groups.begin(), peer.groups.end(), gid) != peer.groups.end();
}

Base* BaseRegistry::Find(absl::string_view name) {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : by_id_.at(it->second).get();
}

Base* BaseRegistry::Find(BaseId id) {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

const Base* BaseRegistry::Find(BaseId id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

const Base* BaseRegistry::FindBySegmentOwner(uint32_t owner) const {
  if (owner < kFirstBaseOwner) return nullptr;
  return Find(owner - kFirstBaseOwner);
}

absl::StatusOr<Base*> BaseRegistry::Create(absl::string_view name, const Session& loader,
                                           std::optional<uint32_t> group, std::string descriptor,
                                           bool job_writable) {
  if (absl::Status s = ValidateBaseName(name); !s.ok()) return s;
  if (job_writable && (loader.job.empty() || group.has_value())) {
    return absl::InvalidArgumentError(
        "a base its job writes needs a session that declared its job, and no group");
  }
  if (descriptor.size() > kMaxBaseDescriptorBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a base's descriptor is at most ",
                                                   kMaxBaseDescriptorBytes, " bytes, not ",
                                                   descriptor.size()));
  }
  if (Find(name) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("a base named '", name, "' exists"));
  }
  const uint32_t uid = loader.peer.uid;
  const size_t mine = std::count_if(by_id_.begin(), by_id_.end(),
                                    [uid](const auto& b) { return b.second->creator == uid; });
  if (mine >= kMaxBasesPerUser) {
    return absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " has made ", mine,
                     " shared bases, the most one user may keep at once; "
                     "release or unpin one (tierctl bases)"));
  }
  if (next_id_ > kMaxBaseId) {
    return absl::ResourceExhaustedError(
        "this daemon has made every shared base it can since it started; restart it");
  }
  if (group) {
    if (std::find(share_groups_.begin(), share_groups_.end(), *group) == share_groups_.end()) {
      return absl::PermissionDeniedError(
          absl::StrCat("group ", *group,
                       " is not one the operator lets bases be shared with "
                       "(daemon.base_groups",
                       share_groups_.empty() ? " is empty" : "", ")"));
    }
    if (!InGroup(loader.peer, *group) && !IsOperator(loader)) {
      return absl::PermissionDeniedError(absl::StrCat(loader.Describe(), " is not in group ",
                                                      *group, ": it cannot share a base with it"));
    }
  }
  auto base = std::make_unique<Base>();
  base->id = next_id_++;
  base->name = std::string(name);
  base->creator = uid;
  base->shared_with_group = group.has_value();
  base->group = group.value_or(0);
  base->loader = loader.id;
  if (job_writable) base->job = loader.job;
  base->descriptor = std::move(descriptor);
  base->holders.insert(loader.id);
  Base* out = base.get();
  by_name_.emplace(out->name, out->id);
  by_id_.emplace(out->id, std::move(base));
  return out;
}

void BaseRegistry::Erase(BaseId id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  by_name_.erase(it->second->name);
  by_id_.erase(it);
}

bool BaseRegistry::MayOpen(const Base& base, const Session& session) const {
  if (IsOperator(session)) return true;
  if (!base.job.empty()) return session.peer.uid == base.creator && session.job == base.job;
  if (session.peer.uid == base.creator) return true;
  return base.shared_with_group && InGroup(session.peer, base.group);
}

bool BaseRegistry::MayWrite(const Base& base, SessionId session, uint32_t uid,
                            absl::string_view job) {
  if (!base.sealed) return base.loader == session;
  return !base.job.empty() && uid == base.creator && job == base.job;
}

std::vector<BaseId> BaseRegistry::HeldBy(SessionId session) const {
  std::vector<BaseId> out;
  for (const auto& [id, base] : by_id_) {
    if (base->holders.contains(session)) out.push_back(id);
  }
  return out;
}

std::vector<const Base*> BaseRegistry::All() const {
  std::vector<const Base*> out;
  for (const auto& [name, id] : by_name_) out.push_back(by_id_.at(id).get());
  return out;
}

}  // namespace tierd::daemon
