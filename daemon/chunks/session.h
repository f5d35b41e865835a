// Sessions: one per client connection on the session socket. A session is identified to gRPC calls
// by its id and an unguessable token; it lives until its session socket closes.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/session_protocol.h"
#include "daemon/chunks/chunk.h"
#include "daemon/chunks/completion_ring.h"

namespace tierd::daemon {

struct PeerCredentials {
  uint32_t uid = 0;
  uint32_t gid = 0;
  pid_t pid = 0;
  std::vector<uint32_t> groups;  // supplementary groups (SO_PEERGROUPS), for shared bases
};

struct Session : std::enable_shared_from_this<Session> {
  SessionId id = 0;
  PeerCredentials peer;
  std::string client_name;
  std::string job;  // empty: none declared
  std::array<uint8_t, kSessionTokenBytes> token{};
  std::unique_ptr<CompletionRing> completions;
  absl::Time opened;
  // Set (under the chunk service's lock) when the session ends; requests that raced with the end
  // see it and change nothing.
  mutable std::atomic<bool> ended{false};

  std::string TokenHex() const;
  // "session 7 (uid 1000, pid 4242, trainer, job run-42)" for messages.
  std::string Describe() const;
};

// OK for a job label (empty: none): 1 to kMaxJobBytes of letters, digits and "._:/-".
absl::Status ValidateJob(absl::string_view job);

class SessionRegistry {
 public:
  // At most `sessions_per_uid` sessions of one user are open at once (limits.sessions_per_uid).
  explicit SessionRegistry(uint32_t sessions_per_uid = UINT32_MAX)
      : sessions_per_uid_(sessions_per_uid) {}

  // RESOURCE_EXHAUSTED, naming the limit, when the user has as many sessions open as allowed, or
  // when `job` is new and kMaxLiveJobs jobs have sessions open (a bounded metrics label);
  // INVALID_ARGUMENT when `job` is not a valid job label (ValidateJob). The client's name is a
  // label for logs and status, nothing more: kept with every byte outside printable ASCII made
  // '?', so that it is valid UTF-8 wherever it is sent and moves no operator's terminal.
  absl::StatusOr<std::shared_ptr<Session>> Open(const PeerCredentials& peer,
                                                absl::string_view client_name,
                                                absl::string_view job = "");
  // Parses "<id>:<token hex>" and returns the live session it names. PERMISSION_DENIED otherwise,
  // in constant time with respect to the token's contents.
  absl::StatusOr<std::shared_ptr<Session>> Authenticate(absl::string_view credential) const;
  // Removes the session; returns it (null if unknown) so the caller can reclaim its resources.
  std::shared_ptr<Session> Close(SessionId id);
  std::vector<std::shared_ptr<Session>> All() const;
  size_t size() const;
  // Sessions open by each user.
  absl::flat_hash_map<uint32_t, uint32_t> CountByUid() const;
  // Sessions open in each declared job.
  absl::flat_hash_map<std::string, uint32_t> CountByJob() const;

 private:
  const uint32_t sessions_per_uid_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint32_t, uint32_t> per_uid_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> per_job_ ABSL_GUARDED_BY(mu_);
  SessionId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tierd::daemon
