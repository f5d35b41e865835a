// ChunkService's shared bases: named, read-only sets of chunks that every allowed session opens
// (chunks/bases.h). One section of the service kept in a file of its own; the same lock and rules.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

namespace {

absl::Status NoSuchBase(absl::string_view name) {
  return absl::NotFoundError(absl::StrCat("there is no shared base named '", name, "'"));
}

}  // namespace

absl::StatusOr<OpenedBase> ChunkService::OpenBase(const Session& session, absl::string_view name,
                                                  const BaseRequest* create) {
  if (absl::Status s = ValidateBaseName(name); !s.ok()) return s;
  if (create != nullptr) {
    if (create->sizes.empty() || create->sizes.size() > kMaxBaseChunks ||
        create->homes.size() != create->sizes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OpenBase: a base is 1 to ", kMaxBaseChunks, " chunks, each with a size and a home; ",
          create->sizes.size(), " sizes and ", create->homes.size(), " homes were given"));
    }
    if (create->descriptor.size() > kMaxBaseDescriptorBytes) {
      return absl::InvalidArgumentError(absl::StrCat("OpenBase: the descriptor is at most ",
                                                     kMaxBaseDescriptorBytes, " bytes, not ",
                                                     create->descriptor.size()));
    }
    for (size_t i = 0; i < create->sizes.size(); ++i) {
      const TierKind home = create->homes[i];
      if (home == TierKind::kDevice) {
        return absl::InvalidArgumentError(
            "OpenBase: a shared base's chunks are at home in the host or NVMe tier (each session "
            "copies what it needs to its own device)");
      }
      if (absl::Status s = CheckTier(home, "OpenBase: home tier"); !s.ok()) return s;
      const uint64_t size = create->sizes[i];
      if (size == 0 || size > tier(home)->max_reservation()) {
        return absl::InvalidArgumentError(absl::StrCat("OpenBase, chunk #", i, ": size ", size,
                                                       " bytes is outside 1 byte to ",
                                                       FormatSize(tier(home)->max_reservation())));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (session.ended) return absl::UnavailableError(absl::StrCat(session.Describe(), " has ended"));
  if (Base* base = bases_.Find(name)) {
    if (!bases_.MayOpen(*base, session)) {
      return absl::PermissionDeniedError(absl::StrCat(
          "the shared base '", name, "' of uid ", base->creator, " is not shared with ",
          session.Describe(),
          base->shared_with_group ? absl::StrCat(" (it is shared with group ", base->group, ")")
                                  : " (its creator shared it with no group)"));
    }
    if (!base->sealed) {
      if (base->loader == session.id) {
        return absl::FailedPreconditionError(
            absl::StrCat("this session is loading the shared base '", name, "': seal it first"));
      }
      return absl::UnavailableError(absl::StrCat("the shared base '", name,
                                                 "' is being loaded by session ", base->loader,
                                                 "; it can be opened once sealed"));
    }
    if (create != nullptr) {
      std::vector<uint64_t> sizes;
      for (ChunkId id : base->chunks) sizes.push_back(chunks_.at(id).size);
      if (sizes != create->sizes || base->descriptor != create->descriptor) {
        return absl::AlreadyExistsError(absl::StrCat(
            "a shared base named '", name, "' exists with other contents (",
            sizes != create->sizes ? "other chunks" : "another descriptor",
            "); nothing of it was changed: open it as it is, or publish under another name"));
      }
    }
    sessions_.Of(session);
    base->holders.insert(session.id);
    return Opened(*base, false);
  }
  if (create == nullptr) return NoSuchBase(name);

  const uint32_t uid = session.peer.uid;
  SessionLedger::State& state = sessions_.Of(session);
  if (absl::Status s = ledger_.CheckChunks(uid, state.owned.size(), create->sizes.size());
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("OpenBase: ", s.message()));
  }
  absl::StatusOr<Base*> made =
      bases_.Create(name, session, create->group, create->descriptor, create->job_writable);
  if (!made.ok()) return made.status();
  Base& base = **made;
  // A base others read sits in segments of its own, which hold nothing else; a job's base is
  // read and written by its creator's sessions only, and sits in the creator's segments (no
  // segment of its own to find: a segment goes to a new owner only when empty).
  const SpaceOwner owner{uid, create->job_writable ? uid : SegmentOwnerOfBase(base.id)};
  std::vector<Placement> placements;
  for (size_t i = 0; i < create->sizes.size(); ++i) {
    absl::StatusOr<Placement> p = space_.Reserve(create->homes[i], owner, create->sizes[i]);
    if (!p.ok()) {
      for (const Placement& q : placements) space_.Release(uid, q);
      bases_.Erase(base.id);
      const bool own_segments = owner.segments != uid && create->homes[i] == TierKind::kHost;
      return absl::Status(
          p.status().code(),
          absl::StrCat("OpenBase, chunk #", i, ": ",
                       own_segments && absl::IsResourceExhausted(p.status())
                           ? "a shared base others read takes host segments of its own (they "
                             "hold nothing else), and one is found only when a segment is empty; "
                             "make the base before the jobs fill the host tier, give it an NVMe "
                             "home, or give the host tier more, smaller segments "
                             "(host.segment_size): "
                           : "",
                       p.status().message()));
    }
    placements.push_back(*p);
  }
  ledger_.AddChunks(uid, static_cast<int64_t>(placements.size()));
  for (size_t i = 0; i < placements.size(); ++i) {
    ChunkMeta& chunk = Insert(uid, /*owner=*/0, create->sizes[i], placements[i], "", false);
    chunk.base = base.id;
    chunk.base_segments = !create->job_writable;
    base.chunks.push_back(chunk.id);
  }
  TIERD_LOG_LIMITED(info, "{} made the shared base '{}' ({} chunks, {})", session.Describe(), name,
                    base.chunks.size(), FormatSize([&] {
                      uint64_t n = 0;
                      for (uint64_t s : create->sizes) n += s;
                      return n;
                    }()));
  return Opened(base, true);
}

OpenedBase ChunkService::Opened(const Base& base, bool created) const {
  OpenedBase out;
  out.id = base.id;
  out.created = created;
  out.creator = base.creator;
  out.descriptor = base.descriptor;
  for (ChunkId id : base.chunks) {
    const ChunkMeta& chunk = chunks_.at(id);
    out.chunks.push_back(id);
    out.sizes.push_back(chunk.size);
    out.homes.push_back(chunk.home);
  }
  return out;
}

absl::Status ChunkService::SealBase(const Session& session, absl::string_view name,
                                    std::string descriptor) {
  if (descriptor.size() > kMaxBaseDescriptorBytes) {
    return absl::InvalidArgumentError(absl::StrCat("SealBase: the descriptor is at most ",
                                                   kMaxBaseDescriptorBytes, " bytes, not ",
                                                   descriptor.size()));
  }
  absl::MutexLock lock(&mu_);
  Base* base = bases_.Find(name);
  if (base == nullptr || !base->holders.contains(session.id)) return NoSuchBase(name);
  if (base->sealed) return absl::OkStatus();
  if (base->loader != session.id) {
    return absl::PermissionDeniedError(
        absl::StrCat("only the session loading the shared base '", name, "' seals it"));
  }
  for (ChunkId id : base->chunks) {
    if (base->job.empty() && chunks_.at(id).writers > 0) {  // a job's base: written on
      return absl::FailedPreconditionError(
          absl::StrCat("SealBase: chunk ", id, " of the shared base '", name,
                       "' is still acquired for writing; release it first"));
    }
  }
  base->sealed = true;
  base->loader = 0;
  if (!descriptor.empty()) base->descriptor = std::move(descriptor);
  TIERD_LOG_LIMITED(info, "{} sealed the shared base '{}'", session.Describe(), name);
  return absl::OkStatus();
}

absl::Status ChunkService::ReleaseBase(const Session& session, absl::string_view name) {
  absl::MutexLock lock(&mu_);
  Base* base = bases_.Find(name);
  if (base == nullptr || !base->holders.contains(session.id)) return NoSuchBase(name);
  if (const SessionLedger::State* state = sessions_.Find(session.id)) {
    for (ChunkId id : base->chunks) {
      if (state->pins.contains(id)) {
        return absl::FailedPreconditionError(
            absl::StrCat("ReleaseBase: chunk ", id, " of the shared base '", name,
                         "' is still acquired by this session; release it first"));
      }
    }
  }
  LeaveBase(*base, session.id);
  room_.RetryQueuedFetches();
  room_freed_.SignalAll();
  return absl::OkStatus();
}

absl::Status ChunkService::PinBase(const Session& session, absl::string_view name, bool pinned) {
  absl::MutexLock lock(&mu_);
  Base* base = bases_.Find(name);
  if (base == nullptr || !bases_.MayOpen(*base, session)) return NoSuchBase(name);
  if (session.peer.uid != base->creator && !IsOperator(session)) {
    return absl::PermissionDeniedError(absl::StrCat("only the shared base's creator (uid ",
                                                    base->creator, ") or an operator pins it"));
  }
  if (!base->sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shared base '", name, "' is still being loaded; pin it once sealed"));
  }
  base->pinned = pinned;
  if (!pinned && base->holders.empty()) {
    DestroyBase(*base);
    room_.RetryQueuedFetches();
    room_freed_.SignalAll();
  }
  return absl::OkStatus();
}

void ChunkService::LeaveBase(Base& base, SessionId session) {
  base.holders.erase(session);
  const bool abandoned = !base.sealed && base.loader == session;
  if (abandoned || (base.holders.empty() && !base.pinned)) {
    if (abandoned) {
      TIERD_LOG_LIMITED(warn,
                        "the shared base '{}' was abandoned by its loader before it was "
                        "sealed; its chunks are freed",
                        base.name);
    }
    DestroyBase(base);
  }
}

void ChunkService::DestroyBase(Base& base) {
  // Only holders pin a base's chunks, and a holder lets go of its pins before its hold; an
  // abandoned base's other holders cannot exist (nobody opens an unsealed base).
  for (ChunkId id : base.chunks) Retire(chunks_.at(id));
  bases_.Erase(base.id);
}

std::vector<BaseStatus> ChunkService::ListBases(const Session& session) const {
  absl::MutexLock lock(&mu_);
  std::vector<BaseStatus> out;
  for (const Base* base : bases_.All()) {
    if (!bases_.MayOpen(*base, session)) continue;
    BaseStatus s;
    s.id = base->id;
    s.name = base->name;
    s.creator = base->creator;
    if (base->shared_with_group) s.group = base->group;
    s.sealed = base->sealed;
    s.pinned = base->pinned;
    s.job = base->job;
    s.chunks = base->chunks.size();
    s.descriptor_bytes = base->descriptor.size();
    for (ChunkId id : base->chunks) {
      const ChunkMeta& chunk = chunks_.at(id);
      s.bytes += chunk.size;
      for (TierKind t : kAllTiers) {
        if (chunk.resident.contains(t)) s.resident_bytes[t] += chunk.size;
      }
    }
    for (SessionId holder : base->holders) {
      const SessionLedger::State* state = sessions_.Find(holder);
      s.holders.push_back(state != nullptr ? state->description : absl::StrCat("session ", holder));
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<bool> ChunkService::MayMapBaseSegment(const Session& session, uint32_t owner) const {
  absl::MutexLock lock(&mu_);
  const Base* base = bases_.FindBySegmentOwner(owner);
  if (base == nullptr || !base->holders.contains(session.id)) {
    return absl::PermissionDeniedError(
        "the segment holds a shared base this session has not opened");
  }
  return BaseRegistry::MayWrite(*base, session.id, session.peer.uid, session.job);
}

absl::Status ChunkService::CheckBaseUse(const Session& session, const ChunkMeta& chunk,
                                        TierKind tier, std::optional<Access> access) const {
  const Base* base = bases_.Find(chunk.base);
  if (base == nullptr) return absl::OkStatus();  // its base went: the chunk is being retired
  if (tier == TierKind::kDevice) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " belongs to the shared base '", base->name,
        "', whose chunks stay in the host and NVMe tiers (copy them to the device yourself)"));
  }
  if (access && Writes(*access) &&
      !BaseRegistry::MayWrite(*base, session.id, session.peer.uid, session.job)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "chunk ", chunk.id, " belongs to the shared base '", base->name, "', which is ",
        base->job.empty() ? std::string("read-only")
                          : absl::StrCat("written by the sessions of job '", base->job, "' only")));
  }
  return absl::OkStatus();
}

}  // namespace tierd::daemon
