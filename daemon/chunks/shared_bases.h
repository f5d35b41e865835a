// Shared bases: named, read-only sets of chunks that every session allowed to may open, so that one
// copy of a frozen model serves every job on the node (docs/streaming.md, "One copy per node").
//
// A base is made by one session (its loader), which fills its chunks and seals it; from then on
// nobody writes it. It lives while a session holds it or it is pinned; the user who made it is
// charged for its space; its chunks sit in segments of their own (kFirstBaseOwner), which sessions
// that hold it map read-only.
//
// A helper of the chunk service, below it: it keeps the bases, who holds them and who may open
// them, and decides each request about them, reserving a new base's space. The service makes the
// chunks it reserved and retires the chunks it hands back (a base that went); it never calls up.
//
// Not thread-safe: the chunk service keeps it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/requests.h"
#include "daemon/chunks/session.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/chunks/space.h"
#include "daemon/chunks/tenant_ledger.h"
#include "daemon/types/ids.h"
#include "daemon/types/tiers.h"

namespace tierd::daemon {

// Bounds on what one client can make the daemon keep.
inline constexpr size_t kMaxBaseNameBytes = 255;
inline constexpr size_t kMaxBaseDescriptorBytes = 1 << 20;  // the client's record of its layout
inline constexpr size_t kMaxBaseChunks = 1 << 16;
inline constexpr size_t kMaxBasesPerUser = 64;

struct Base {
  BaseId id = 0;
  std::string name;
  uint32_t creator = 0;  // uid, charged for the base's space
  uint32_t group = 0;    // with `shared_with_group`: members may open it
  bool shared_with_group = false;
  std::string job;       // job_writable: the job whose sessions write it; else empty
  SessionId loader = 0;  // the session filling it; 0 once sealed
  bool sealed = false;
  bool pinned = false;     // kept without a holder (tierctl base pin)
  std::string descriptor;  // opaque to the daemon: what the loader says the chunks hold
  std::vector<ChunkId> chunks;
  std::set<SessionId> holders;
};

// OpenBase's request to make the base when it does not exist: its chunks (each a size and a home
// tier, host or NVMe), the group it is shared with, and the loader's descriptor of its contents.
struct BaseRequest {
  std::vector<uint64_t> sizes;
  std::vector<TierKind> homes;
  std::optional<uint32_t> group;
  std::string descriptor;
  // The ranks of one job share one set of weights they all step: once sealed, the base stays
  // writable by the sessions of its creator's user that declared the creator's job, and only
  // they (and operators, read-only) open it. Needs a job.
  bool job_writable = false;
};

// A base as a session that opened it sees it.
struct OpenedBase {
  BaseId id = 0;
  bool created = false;  // this session made it and loads it: it writes the chunks, then seals
  uint32_t creator = 0;
  std::vector<ChunkId> chunks;
  std::vector<uint64_t> sizes;
  std::vector<TierKind> homes;
  std::string descriptor;
};

// A base as tierctl and the metrics see it.
struct BaseStatus {
  BaseId id = 0;
  std::string name;
  uint32_t creator = 0;
  std::optional<uint32_t> group;
  bool sealed = false, pinned = false;
  std::string job;  // a base its job writes
  uint64_t chunks = 0, bytes = 0;
  TierArray<uint64_t> resident_bytes{};
  std::vector<std::string> holders;  // the sessions holding it, described
  uint64_t descriptor_bytes = 0;
};

// OK for a base name: 1 to kMaxBaseNameBytes of letters, digits and "._-/@:", no empty path
// component.
absl::Status ValidateBaseName(absl::string_view name);

class SharedBases {
 public:
  // The service's table, ledgers and space, read (and, for a new base's space, changed) under its
  // lock.
  SharedBases(const ChunkTable& chunks, const SessionLedger& sessions, Space& space,
              TenantLedger& ledger)
      : chunks_(chunks), sessions_(sessions), space_(space), ledger_(ledger) {}
  SharedBases(const SharedBases&) = delete;
  SharedBases& operator=(const SharedBases&) = delete;

  // Node-wide groups whose members a base may be shared with (the operator's daemon.base_groups).
  void set_share_groups(std::vector<uint32_t> gids) { share_groups_ = std::move(gids); }

  // What OpenBase may check before the service's lock: the name, and a creation request's shape
  // (chunk count, descriptor, each chunk's home and size against its tier in `tiers`).
  static absl::Status CheckOpen(absl::string_view name, const BaseRequest* create,
                                const Tiers& tiers);

  // An open, as far as the bases go: the base the session now holds and, when it made it, the
  // space reserved for its chunks (one placement per chunk, in order), which the service makes
  // as chunks and hands to Attach.
  struct Opening {
    Base* base = nullptr;
    std::vector<Placement> to_make;
  };
  // Holds the sealed base `name` for the session; without one and with `create`, makes it for the
  // session to load, reserving its space and counting its chunks against the creator's limit
  // (`session_chunks`: how many the session owns). Errors as ChunkService::OpenBase says; nothing
  // changes on an error. REQUIRES: CheckOpen passed.
  absl::StatusOr<Opening> Open(const Session& session, absl::string_view name,
                               const BaseRequest* create, size_t session_chunks);
  // A chunk the service made for the base from Opening::to_make, in order.
  void Attach(Base& base, ChunkMeta& chunk);
  // The base as the session that opened it sees it.
  OpenedBase Opened(const Base& base, bool created) const;

  absl::Status Seal(const Session& session, absl::string_view name, std::string descriptor);
  // The chunks the service retires: those of a base that went with the session's hold (the
  // loader's before sealing, or the last hold of an unpinned base); none when it stays.
  absl::StatusOr<std::vector<ChunkId>> Release(const Session& session, absl::string_view name);
  absl::StatusOr<std::vector<ChunkId>> Pin(const Session& session, absl::string_view name,
                                           bool pinned);
  // The session ended: its holds go. The chunks of the bases that went with them.
  std::vector<ChunkId> LeaveAll(SessionId session);

  std::vector<BaseStatus> List(const Session& session) const;
  absl::StatusOr<bool> MayMapSegment(const Session& session, uint32_t owner) const;
  // Resolve's rule for a base's chunk: PERMISSION_DENIED unless the session holds its base.
  absl::Status CheckHeld(const ChunkMeta& chunk, const Session& session) const;
  // Why the session cannot use the base chunk as `access` in `tier` (OK when it may).
  absl::Status CheckUse(const Session& session, const ChunkMeta& chunk, TierKind tier,
                        std::optional<Access> access) const;

  // The base's name, for listings; empty when it went (its chunks are being retired).
  std::string NameOf(BaseId id) const;
  size_t size() const { return by_id_.size(); }
  uint64_t holders() const;

 private:
  Base* Find(absl::string_view name);
  const Base* Find(BaseId id) const;
  // A new, unsealed base that `loader` fills. ALREADY_EXISTS for a name in use; RESOURCE_EXHAUSTED
  // when the user holds kMaxBasesPerUser bases or the daemon has made every base id it can;
  // PERMISSION_DENIED for a group the operator did not name, or one the creator is not in (an
  // operator shares with any group the operator named).
  // With `job_writable`, the base is its loader's job's (Base::job): INVALID_ARGUMENT when the
  // loader declared none, or with a group too.
  absl::StatusOr<Base*> Create(absl::string_view name, const Session& loader,
                               std::optional<uint32_t> group, std::string descriptor,
                               bool job_writable);
  // Reserves the space of a new base's chunks; on a failure, none is left reserved.
  absl::StatusOr<std::vector<Placement>> Reserve(const Base& base, const BaseRequest& create);
  // Whether the session may open the base: its creator's uid, an operator, or a member of the
  // group it is shared with (a group the operator named); a job's base: an operator, or a
  // session of its creator's user in its job.
  bool MayOpen(const Base& base, const Session& session) const;
  // Whether the session writes the base: its loader before sealing; a job's base, a session of
  // its creator's user in its job.
  static bool MayWrite(const Base& base, SessionId session, uint32_t uid, absl::string_view job);
  // `session` lets go of the base; returns its chunks when it goes (its loader's hold before
  // sealing, or the last hold of an unpinned base).
  std::vector<ChunkId> Leave(Base& base, SessionId session);
  std::vector<ChunkId> Erase(Base& base);

  const ChunkTable& chunks_;
  const SessionLedger& sessions_;
  Space& space_;
  TenantLedger& ledger_;
  std::map<BaseId, std::unique_ptr<Base>> by_id_;
  std::map<std::string, BaseId, std::less<>> by_name_;
  std::vector<uint32_t> share_groups_;
  BaseId next_id_ = 1;  // never reused: a base's segments are fresh memory for the next owner
};

// Whether the peer is in group `gid` (its primary group or one of its supplementary ones).
bool InGroup(const PeerCredentials& peer, uint32_t gid);

}  // namespace tierd::daemon
