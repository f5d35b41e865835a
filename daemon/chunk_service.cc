#include "daemon/chunk_service.h"

#include <algorithm>
#include <cassert>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/sizes.h"

namespace tierd {
namespace {

// Tiers from fastest to slowest: a chunk evicted to a tier loses its copies in faster ones.
int Rank(TierKind tier) {
  switch (tier) {
    case TierKind::kDevice:
      return 2;
    case TierKind::kHost:
      return 1;
    case TierKind::kNvme:
      return 0;
  }
  return -1;
}

absl::Status Ended(const Session& session) {
  return absl::UnavailableError(absl::StrCat(session.Describe(), " has ended"));
}

absl::Status CheckBatch(size_t n, absl::string_view what) {
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": the batch is empty"));
  if (n > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a batch holds at most ", kMaxBatch, " chunks, not ", n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateChunkName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk name must be 1 to ", kMaxNameBytes, " bytes, not ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-' && c != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", absl::CHexEscape(name),
                       "' has a character outside letters, digits and '._-/'"));
    }
  }
  for (absl::string_view part : absl::StrSplit(name, '/')) {
    if (part.empty() || part == "." || part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk name '", name, "' has an empty, '.' or '..' path component"));
    }
  }
  return absl::OkStatus();
}

ChunkService::ChunkService(std::array<Tier*, kTierKinds> tiers) : tiers_(tiers) {
  assert(tiers_[static_cast<int>(TierKind::kHost)] != nullptr);
}

std::string ChunkService::NameKey(uint32_t tenant, absl::string_view name) {
  return absl::StrCat(tenant, "/", name);
}

absl::Status ChunkService::CheckTier(TierKind tier, absl::string_view what) const {
  if (tiers_[static_cast<int>(tier)] == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the ", TierName(tier), " tier is not configured on this node (see ",
                     tier == TierKind::kNvme ? "[nvme]" : "[device]", " in the tierd config)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ChunkMeta*>> ChunkService::Resolve(const Session& session,
                                                              std::span<const ChunkId> ids) {
  std::vector<ChunkMeta*> out;
  out.reserve(ids.size());
  absl::flat_hash_set<ChunkId> seen;
  if (ids.size() > 1) seen.reserve(ids.size());
  for (ChunkId id : ids) {
    auto it = chunks_.find(id);
    if (it == chunks_.end()) {
      return absl::NotFoundError(absl::StrCat("chunk ", id, " does not exist"));
    }
    ChunkMeta& chunk = it->second;
    const bool allowed =
        chunk.persistent ? chunk.tenant == session.peer.uid : chunk.owner == session.id;
    if (!allowed) {
      return absl::PermissionDeniedError(absl::StrCat("chunk ", id, " belongs to another ",
                                                      chunk.persistent ? "tenant" : "session", "; ",
                                                      session.Describe(), " cannot use it"));
    }
    if (ids.size() > 1 && !seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", id, " appears twice in the batch"));
    }
    out.push_back(&chunk);
  }
  return out;
}

absl::StatusOr<std::vector<ChunkId>> ChunkService::Allocate(
    const Session& session, std::span<const ChunkRequest> requests) {
  if (absl::Status s = CheckBatch(requests.size(), "Allocate"); !s.ok()) return s;
  const uint32_t tenant = session.peer.uid;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);

  // Validate everything before reserving anything.
  std::vector<ChunkId> result(requests.size(), 0);
  absl::flat_hash_set<absl::string_view> batch_names;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ChunkRequest& r = requests[i];
    auto fail = [i](const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("Allocate, chunk #", i, ": ", s.message()));
    };
    if (absl::Status s = CheckTier(r.home, "home tier"); !s.ok()) return fail(s);
    Tier* home = tier(r.home);
    if (r.size == 0 || r.size > home->max_reservation()) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "size ", r.size, " bytes is outside 1 byte to ", FormatSize(home->max_reservation()),
          " (the largest chunk the ", TierName(r.home), " tier holds)")));
    }
    if (r.persistent && r.name.empty()) {
      return fail(absl::InvalidArgumentError("a persistent chunk needs a name"));
    }
    if (r.tags.size() > kMaxTags) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat(r.tags.size(), " tags; at most ", kMaxTags, " are allowed")));
    }
    for (const std::string& tag : r.tags) {
      if (tag.empty() || tag.size() > kMaxTagBytes) {
        return fail(
            absl::InvalidArgumentError(absl::StrCat("tags must be 1 to ", kMaxTagBytes, " bytes")));
      }
    }
    if (r.name.empty()) continue;
    if (absl::Status s = ValidateChunkName(r.name); !s.ok()) return fail(s);
    if (!batch_names.insert(r.name).second) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("name '", r.name, "' appears twice in the batch")));
    }
    auto existing = names_.find(NameKey(tenant, r.name));
    if (existing == names_.end()) continue;
    const ChunkMeta& found = chunks_.at(existing->second);
    if (!(r.open_existing && r.persistent && found.persistent)) {
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "uid ", tenant, " already has ", found.persistent ? "a persistent" : "a scratch",
          " chunk named '", r.name, "' (chunk ", found.id, ")",
          found.persistent ? "; set open_existing to open it" : "")));
    }
    if (found.size != r.size || found.home != r.home) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "persistent chunk '", r.name, "' (chunk ", found.id, ") has size ", found.size,
          " in the ", TierName(found.home), " tier, not ", r.size, " in ", TierName(r.home))));
    }
    result[i] = found.id;
  }

  // Reserve space for the new chunks; give it all back if any reservation fails.
  std::vector<Placement> placements(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (result[i] != 0) continue;
    absl::StatusOr<Placement> p = tier(requests[i].home)->Reserve(tenant, requests[i].size);
    if (!p.ok()) {
      for (size_t j = 0; j < i; ++j) {
        if (result[j] == 0) tier(requests[j].home)->Unreserve(placements[j]);
      }
      return absl::Status(p.status().code(),
                          absl::StrCat("Allocate, chunk #", i, ": ", p.status().message()));
    }
    placements[i] = *p;
  }

  SessionState& state = sessions_[session.id];
  for (size_t i = 0; i < requests.size(); ++i) {
    const ChunkRequest& r = requests[i];
    if (result[i] != 0) {  // an opened persistent chunk
      chunks_.at(result[i]).owner = session.id;
      continue;
    }
    const ChunkId id = next_id_++;
    ChunkMeta& chunk = chunks_[id];
    chunk.id = id;
    chunk.size = r.size;
    chunk.owner = session.id;
    chunk.tenant = tenant;
    chunk.home = r.home;
    chunk.resident.insert(r.home);
    chunk.persistent = r.persistent;
    chunk.placement[static_cast<int>(r.home)] = placements[i];
    chunk.name = r.name;
    chunk.tags = r.tags;
    if (!r.name.empty()) names_[NameKey(tenant, r.name)] = id;
    if (r.persistent) {
      persistent_[tenant].insert(id);
    } else {
      state.owned.insert(id);
    }
    result[i] = id;
  }
  return result;
}

void ChunkService::Destroy(ChunkMeta& chunk) {
  for (int t = 1; t < kTierKinds; ++t) {
    if (chunk.resident.contains(static_cast<TierKind>(t))) {
      tiers_[t]->Unreserve(chunk.placement[t]);
    }
  }
  if (!chunk.name.empty()) names_.erase(NameKey(chunk.tenant, chunk.name));
  if (chunk.persistent) {
    auto it = persistent_.find(chunk.tenant);
    it->second.erase(chunk.id);
    if (it->second.empty()) persistent_.erase(it);
  } else if (auto it = sessions_.find(chunk.owner); it != sessions_.end()) {
    it->second.owned.erase(chunk.id);
  }
  chunks_.erase(chunk.id);
}

absl::Status ChunkService::Free(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Free"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (absl::Status s = CheckFreeable(*chunk); !s.ok()) return s;
  }
  for (ChunkMeta* chunk : *chunks) Destroy(*chunk);
  return absl::OkStatus();
}

absl::StatusOr<AcquireResult> ChunkService::Acquire(const Session& session,
                                                    std::span<const ChunkId> ids, TierKind tier,
                                                    Access access) {
  if (absl::Status s = CheckBatch(ids.size(), "Acquire"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Acquire"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (absl::Status s = CheckPin(*chunk, tier); !s.ok()) return s;
  }
  // Every copy is resident, so the batch is ready now. (Acquire of a chunk still in transit will
  // post a pending token that the transfer completes.)
  absl::StatusOr<SlotToken> token = session.completions->PostCompleted(absl::OkStatus());
  if (!token.ok()) return token.status();

  AcquireResult result;
  result.ready = *token;
  result.locations.reserve(ids.size());
  SessionState& state = sessions_[session.id];
  for (ChunkMeta* chunk : *chunks) {
    Pin(*chunk, tier, access);
    state.pins[chunk->id] += 1;
    result.locations.push_back(chunk->placement[static_cast<int>(tier)]);
  }
  return result;
}

absl::Status ChunkService::Release(const Session& session, std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Release"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  SessionState& state = sessions_[session.id];
  for (const ChunkMeta* chunk : *chunks) {
    if (!state.pins.contains(chunk->id)) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is not acquired by ", session.Describe()));
    }
  }
  for (ChunkMeta* chunk : *chunks) {
    Unpin(*chunk);
    auto it = state.pins.find(chunk->id);
    if (--it->second == 0) state.pins.erase(it);
  }
  return absl::OkStatus();
}

absl::StatusOr<SlotToken> ChunkService::Prefetch(const Session& session,
                                                 std::span<const ChunkId> ids, TierKind tier,
                                                 int /*priority*/) {
  if (absl::Status s = CheckBatch(ids.size(), "Prefetch"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Prefetch"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (chunk->state == ChunkState::kMoving && chunk->moving_to != tier) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is being moved to ", TierName(chunk->moving_to)));
    }
    if (!chunk->resident.contains(tier)) {
      // Only reachable once a second tier is configured, which needs a data path to it.
      return absl::FailedPreconditionError(absl::StrCat("chunk ", chunk->id,
                                                        ": this daemon has no data path into the ",
                                                        TierName(tier), " tier"));
    }
  }
  return session.completions->PostCompleted(absl::OkStatus());
}

absl::StatusOr<SlotToken> ChunkService::Evict(const Session& session, std::span<const ChunkId> ids,
                                              TierKind tier) {
  if (absl::Status s = CheckBatch(ids.size(), "Evict"); !s.ok()) return s;
  if (absl::Status s = CheckTier(tier, "Evict"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (session.ended) return Ended(session);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  for (const ChunkMeta* chunk : *chunks) {
    if (chunk->state == ChunkState::kMoving) {
      return absl::FailedPreconditionError(
          absl::StrCat("chunk ", chunk->id, " is being moved to ", TierName(chunk->moving_to)));
    }
    if (Rank(tier) > Rank(chunk->home)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", chunk->id, " lives in the ", TierName(chunk->home),
          " tier; it cannot be evicted up to the ", TierName(tier), " tier (use Prefetch)"));
    }
    for (int t = 1; t < kTierKinds; ++t) {
      const auto above = static_cast<TierKind>(t);
      if (Rank(above) > Rank(tier) && chunk->resident.contains(above) && chunk->pins > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "chunk ", chunk->id, " is acquired; release it before evicting it from the ",
            TierName(above), " tier"));
      }
    }
    if (!chunk->resident.contains(tier)) {
      return absl::FailedPreconditionError(absl::StrCat("chunk ", chunk->id,
                                                        ": this daemon has no data path into the ",
                                                        TierName(tier), " tier"));
    }
  }
  // With the host tier alone every chunk already lives in its lowest tier: nothing moves.
  return session.completions->PostCompleted(absl::OkStatus());
}

absl::StatusOr<std::vector<ChunkMeta>> ChunkService::Stat(const Session& session,
                                                          std::span<const ChunkId> ids) {
  if (absl::Status s = CheckBatch(ids.size(), "Stat"); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, ids);
  if (!chunks.ok()) return chunks.status();
  std::vector<ChunkMeta> out;
  out.reserve(chunks->size());
  for (const ChunkMeta* chunk : *chunks) out.push_back(*chunk);
  return out;
}

ChunkPage ChunkService::List(const Session& session, ChunkId page_token, uint32_t page_size) const {
  if (page_size == 0) page_size = kDefaultPageSize;
  page_size = std::min(page_size, kMaxPageSize);
  absl::MutexLock lock(&mu_);
  static const std::set<ChunkId> kNone;
  const std::set<ChunkId>* owned = &kNone;
  if (auto it = sessions_.find(session.id); it != sessions_.end()) owned = &it->second.owned;
  const std::set<ChunkId>* persistent = &kNone;
  if (auto it = persistent_.find(session.peer.uid); it != persistent_.end()) {
    persistent = &it->second;
  }
  ChunkPage page;
  auto a = owned->lower_bound(page_token);
  auto b = persistent->lower_bound(page_token);
  while (a != owned->end() || b != persistent->end()) {
    ChunkId next;
    if (b == persistent->end() || (a != owned->end() && *a < *b)) {
      next = *a++;
    } else {
      next = *b++;
    }
    if (page.chunks.size() == page_size) {
      page.next_page_token = next;
      break;
    }
    page.chunks.push_back(chunks_.at(next));
  }
  return page;
}

size_t ChunkService::CloseSession(const Session& session) {
  absl::MutexLock lock(&mu_);
  session.ended = true;
  auto it = sessions_.find(session.id);
  if (it == sessions_.end()) return 0;
  SessionState state = std::move(it->second);
  sessions_.erase(it);
  for (const auto& [id, count] : state.pins) {
    ChunkMeta& chunk = chunks_.at(id);
    for (uint32_t i = 0; i < count; ++i) Unpin(chunk);
  }
  size_t freed = 0;
  for (ChunkId id : state.owned) {
    ChunkMeta& chunk = chunks_.at(id);
    assert(chunk.pins == 0);  // only its owner can pin a scratch chunk
    assert(chunk.state == ChunkState::kReady);
    Destroy(chunk);
    ++freed;
  }
  if (auto p = persistent_.find(session.peer.uid); p != persistent_.end()) {
    for (ChunkId id : p->second) {
      ChunkMeta& chunk = chunks_.at(id);
      if (chunk.owner == session.id) chunk.owner = 0;
    }
  }
  return freed;
}

size_t ChunkService::chunk_count() const {
  absl::MutexLock lock(&mu_);
  return chunks_.size();
}

}  // namespace tierd
