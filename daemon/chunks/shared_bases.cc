#include "daemon/chunks/shared_bases.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

namespace {

absl::Status NoSuchBase(absl::string_view name) {
  return absl::NotFoundError(absl::StrCat("there is no shared base named '", name, "'"));
}

}  // namespace

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

Base* SharedBases::Find(absl::string_view name) {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : by_id_.at(it->second).get();
}

const Base* SharedBases::Find(BaseId id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

absl::StatusOr<Base*> SharedBases::Create(absl::string_view name, const Session& loader,
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

bool SharedBases::MayOpen(const Base& base, const Session& session) const {
  if (IsOperator(session)) return true;
  if (!base.job.empty()) return session.peer.uid == base.creator && session.job == base.job;
  if (session.peer.uid == base.creator) return true;
  return base.shared_with_group && InGroup(session.peer, base.group);
}

bool SharedBases::MayWrite(const Base& base, SessionId session, uint32_t uid,
                           absl::string_view job) {
  if (!base.sealed) return base.loader == session;
  return !base.job.empty() && uid == base.creator && job == base.job;
}

absl::Status SharedBases::CheckOpen(absl::string_view name, const BaseRequest* create,
                                    const Tiers& tiers) {
  if (absl::Status s = ValidateBaseName(name); !s.ok()) return s;
  if (create == nullptr) return absl::OkStatus();
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
    if (absl::Status s = CheckTierConfigured(tiers, home, "OpenBase: home tier"); !s.ok()) {
      return s;
    }
    const Tier* tier = tiers.tier[home];
    const uint64_t size = create->sizes[i];
    if (size == 0 || size > tier->max_reservation()) {
      return absl::InvalidArgumentError(absl::StrCat("OpenBase, chunk #", i, ": size ", size,
                                                     " bytes is outside 1 byte to ",
                                                     FormatSize(tier->max_reservation())));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<SharedBases::Opening> SharedBases::Open(const Session& session,
                                                       absl::string_view name,
                                                       const BaseRequest* create,
                                                       size_t session_chunks) {
  if (Base* base = Find(name)) {
    if (!MayOpen(*base, session)) {
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
    base->holders.insert(session.id);
    return Opening{base, {}};
  }
  if (create == nullptr) return NoSuchBase(name);

  const uint32_t uid = session.peer.uid;
  if (absl::Status s = ledger_.CheckChunks(uid, session_chunks, create->sizes.size()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("OpenBase: ", s.message()));
  }
  absl::StatusOr<Base*> made =
      Create(name, session, create->group, create->descriptor, create->job_writable);
  if (!made.ok()) return made.status();
  absl::StatusOr<std::vector<Placement>> placements = Reserve(**made, *create);
  if (!placements.ok()) {
    Erase(**made);
    return placements.status();
  }
  ledger_.AddChunks(uid, static_cast<int64_t>(placements->size()));
  TIERD_LOG_LIMITED(info, "{} made the shared base '{}' ({} chunks, {})", session.Describe(), name,
                    placements->size(), FormatSize([&] {
                      uint64_t n = 0;
                      for (uint64_t size : create->sizes) n += size;
                      return n;
                    }()));
  return Opening{*made, *std::move(placements)};
}

absl::StatusOr<std::vector<Placement>> SharedBases::Reserve(const Base& base,
                                                            const BaseRequest& create) {
  // A base others read sits in segments of its own, which hold nothing else; a job's base is
  // read and written by its creator's sessions only, and sits in the creator's segments (no
  // segment of its own to find: a segment goes to a new owner only when empty).
  const uint32_t uid = base.creator;
  const SpaceOwner owner{uid, base.job.empty() ? SegmentOwnerOfBase(base.id) : uid};
  std::vector<Placement> placements;
  for (size_t i = 0; i < create.sizes.size(); ++i) {
    absl::StatusOr<Placement> p = space_.Reserve(create.homes[i], owner, create.sizes[i]);
    if (!p.ok()) {
      for (const Placement& q : placements) space_.Release(uid, q);
      const bool own_segments = owner.segments != uid && create.homes[i] == TierKind::kHost;
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
  return placements;
}

void SharedBases::Attach(Base& base, ChunkMeta& chunk) {
  chunk.base = base.id;
  chunk.base_segments = base.job.empty();
  base.chunks.push_back(chunk.id);
}

OpenedBase SharedBases::Opened(const Base& base, bool created) const {
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

absl::Status SharedBases::Seal(const Session& session, absl::string_view name,
                               std::string descriptor) {
  if (descriptor.size() > kMaxBaseDescriptorBytes) {
    return absl::InvalidArgumentError(absl::StrCat("SealBase: the descriptor is at most ",
                                                   kMaxBaseDescriptorBytes, " bytes, not ",
                                                   descriptor.size()));
  }
  Base* base = Find(name);
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

absl::StatusOr<std::vector<ChunkId>> SharedBases::Release(const Session& session,
                                                          absl::string_view name) {
  Base* base = Find(name);
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
  return Leave(*base, session.id);
}

absl::StatusOr<std::vector<ChunkId>> SharedBases::Pin(const Session& session,
                                                      absl::string_view name, bool pinned) {
  Base* base = Find(name);
  if (base == nullptr || !MayOpen(*base, session)) return NoSuchBase(name);
  if (session.peer.uid != base->creator && !IsOperator(session)) {
    return absl::PermissionDeniedError(absl::StrCat("only the shared base's creator (uid ",
                                                    base->creator, ") or an operator pins it"));
  }
  if (!base->sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat("the shared base '", name, "' is still being loaded; pin it once sealed"));
  }
  base->pinned = pinned;
  if (!pinned && base->holders.empty()) return Erase(*base);
  return std::vector<ChunkId>();
}

std::vector<ChunkId> SharedBases::LeaveAll(SessionId session) {
  std::vector<Base*> held;
  for (const auto& [id, base] : by_id_) {
    if (base->holders.contains(session)) held.push_back(base.get());
  }
  std::vector<ChunkId> gone;
  for (Base* base : held) {
    std::vector<ChunkId> chunks = Leave(*base, session);
    gone.insert(gone.end(), chunks.begin(), chunks.end());
  }
  return gone;
}

std::vector<ChunkId> SharedBases::Leave(Base& base, SessionId session) {
  base.holders.erase(session);
  const bool abandoned = !base.sealed && base.loader == session;
  if (!abandoned && (!base.holders.empty() || base.pinned)) return {};
  if (abandoned) {
    TIERD_LOG_LIMITED(warn,
                      "the shared base '{}' was abandoned by its loader before it was sealed; its "
                      "chunks are freed",
                      base.name);
  }
  return Erase(base);
}

std::vector<ChunkId> SharedBases::Erase(Base& base) {
  // Only holders pin a base's chunks, and a holder lets go of its pins before its hold; an
  // abandoned base's other holders cannot exist (nobody opens an unsealed base).
  std::vector<ChunkId> chunks = std::move(base.chunks);
  const BaseId id = base.id;
  by_name_.erase(base.name);
  by_id_.erase(id);  // `base` goes here
  return chunks;
}

std::vector<BaseStatus> SharedBases::List(const Session& session) const {
  std::vector<BaseStatus> out;
  for (const auto& [name, id] : by_name_) {
    const Base& base = *by_id_.at(id);
    if (!MayOpen(base, session)) continue;
    BaseStatus s;
    s.id = base.id;
    s.name = base.name;
    s.creator = base.creator;
    if (base.shared_with_group) s.group = base.group;
    s.sealed = base.sealed;
    s.pinned = base.pinned;
    s.job = base.job;
    s.chunks = base.chunks.size();
    s.descriptor_bytes = base.descriptor.size();
    for (ChunkId chunk_id : base.chunks) {
      const ChunkMeta& chunk = chunks_.at(chunk_id);
      s.bytes += chunk.size;
      for (TierKind t : kAllTiers) {
        if (chunk.resident.contains(t)) s.resident_bytes[t] += chunk.size;
      }
    }
    for (SessionId holder : base.holders) {
      const SessionLedger::State* state = sessions_.Find(holder);
      s.holders.push_back(state != nullptr ? state->description : absl::StrCat("session ", holder));
    }
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<bool> SharedBases::MayMapSegment(const Session& session, uint32_t owner) const {
  const Base* base = owner >= kFirstBaseOwner ? Find(owner - kFirstBaseOwner) : nullptr;
  if (base == nullptr || !base->holders.contains(session.id)) {
    return absl::PermissionDeniedError(
        "the segment holds a shared base this session has not opened");
  }
  return MayWrite(*base, session.id, session.peer.uid, session.job);
}

absl::Status SharedBases::CheckHeld(const ChunkMeta& chunk, const Session& session) const {
  const Base* base = Find(chunk.base);
  if (base != nullptr && base->holders.contains(session.id)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("chunk ", chunk.id, " belongs to a shared base ",
                                                  session.Describe(),
                                                  " has not opened (OpenBase)"));
}

absl::Status SharedBases::CheckUse(const Session& session, const ChunkMeta& chunk, TierKind tier,
                                   std::optional<Access> access) const {
  const Base* base = Find(chunk.base);
  if (base == nullptr) return absl::OkStatus();  // its base went: the chunk is being retired
  if (tier == TierKind::kDevice) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chunk ", chunk.id, " belongs to the shared base '", base->name,
        "', whose chunks stay in the host and NVMe tiers (copy them to the device yourself)"));
  }
  if (access && Writes(*access) && !MayWrite(*base, session.id, session.peer.uid, session.job)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "chunk ", chunk.id, " belongs to the shared base '", base->name, "', which is ",
        base->job.empty() ? std::string("read-only")
                          : absl::StrCat("written by the sessions of job '", base->job, "' only")));
  }
  return absl::OkStatus();
}

std::string SharedBases::NameOf(BaseId id) const {
  const Base* base = Find(id);
  return base != nullptr ? base->name : std::string();
}

uint64_t SharedBases::holders() const {
  uint64_t n = 0;
  for (const auto& [id, base] : by_id_) n += base->holders.size();
  return n;
}

}  // namespace tierd::daemon
