#include "daemon/chunks/space.h"

#include <algorithm>

#include "common/sizes.h"
#include "daemon/tiers/segment_pool.h"

namespace tierd::daemon {

absl::StatusOr<Placement> Space::Reserve(TierKind kind, SpaceOwner owner, uint64_t size,
                                         bool quota) {
  const uint32_t tenant = owner.tenant;
  absl::StatusOr<Placement> p = tier(kind)->Reserve(owner.segments, size);
  if (!p.ok()) return p;
  if (absl::Status s = quota ? ledger_.CheckBytes(tenant, kind, p->size) : absl::OkStatus();
      !s.ok()) {
    tier(kind)->Unreserve(*p);
    return s;
  }
  ledger_.AddBytes(tenant, kind, p->size);
  return p;
}

void Space::Release(uint32_t tenant, const Placement& placement) {
  tier(placement.tier)->Unreserve(placement);
  ledger_.RemoveBytes(tenant, placement.tier, placement.size);
}

void Space::DropCopy(ChunkMeta& chunk, TierKind tier) {
  if (chunk.allocated.contains(tier)) Release(chunk.tenant, chunk.placement[tier]);
  chunk.allocated.erase(tier);
  chunk.unplanned.erase(tier);
  chunk.resident.erase(tier);
  chunk.dirty.erase(tier);
  chunks_.Reindex(chunk);
}

absl::StatusOr<Placement> Space::ReserveIn(TierKind tier, SpaceOwner owner, uint64_t size) {
  const uint32_t tenant = owner.tenant;
  for (;;) {
    // When the tenant's quota is what is full, only its own copies make room for it.
    const uint64_t needed = AlignUp(size, kSegmentAlignment);
    const bool quota_full = ledger_.Headroom(tenant, tier) < needed;
    if (quota_full && planning_) return ledger_.CheckBytes(tenant, tier, needed);
    absl::StatusOr<Placement> p =
        quota_full ? absl::ResourceExhaustedError("over quota") : Reserve(tier, owner, size);
    if (p.ok() || !absl::IsResourceExhausted(p.status()) || planning_) return p;
    // Full: drop a copy there that a lower tier also holds (a clean copy costs nothing to drop):
    // of the oldest kWantedLooked, the first in RoomOrder.
    ChunkMeta* victim = nullptr;
    RoomOrder first;
    size_t looked = 0;
    const absl::Time now = clock_.Now();
    chunks_.VisitOldestIn(tier, [&](ChunkMeta& c) {
      if (c.state != ChunkState::kReady || c.pins > 0 || c.doomed || !CleanIn(c.resident, tier) ||
          (quota_full && c.tenant != tenant)) {
        return true;
      }
      const RoomOrder order = RoomOrderOf(c, tier, now);
      if (victim == nullptr || order < first) {
        victim = &c;
        first = order;
      }
      return first.group != RoomOrder::kUnreadVersion && ++looked < kWantedLooked;
    });
    if (victim == nullptr) return quota_full ? ledger_.CheckBytes(tenant, tier, needed) : p;
    DropCopy(*victim, tier);
  }
}

absl::Status Space::PlaceIn(ChunkMeta& chunk, TierKind tier) {
  absl::StatusOr<Placement> p =
      ReserveIn(tier, OwnerOf(chunk), SpaceIn(tier, chunk.size, chunk.persistent));
  if (!p.ok()) return p.status();
  chunk.placement[tier] = *p;
  chunk.allocated.insert(tier);
  if (!planning_) chunk.unplanned.insert(tier);
  return absl::OkStatus();
}

uint64_t Space::SpaceIn(TierKind t, uint64_t size, bool persistent) const {
  if (t != TierKind::kNvme || !persistent || tiers_.index == nullptr) return size;
  return std::max(size, tiers_.index->persistent_granule());
}

uint64_t Space::FreeFor(uint32_t tenant, TierKind t) const {
  const TierUsage u = tier(t)->Usage();
  const uint64_t free = u.capacity_bytes - std::min(u.capacity_bytes, u.used_bytes);
  return std::min(free, ledger_.Headroom(tenant, t));
}

bool Space::CouldHold(uint32_t tenant, TierKind t, uint64_t size, uint64_t beside) const {
  const uint64_t needed = AlignUp(size, kSegmentAlignment) + beside;
  const uint64_t quota = ledger_.quotas().For(tenant)[t];
  return size <= tier(t)->max_reservation() && needed <= tier(t)->Usage().capacity_bytes &&
         (quota == 0 || needed <= quota);
}

std::vector<TierKind> RoomNeeded(const ChunkMeta& chunk, TierKind tier, Access access) {
  std::vector<TierKind> needs;
  if (access == Access::kOverwrite && chunk.state == ChunkState::kReady) {
    if (!chunk.allocated.contains(tier)) needs.push_back(tier);
    return needs;
  }
  if (!chunk.allocated.contains(TierKind::kHost)) needs.push_back(TierKind::kHost);
  if (tier == TierKind::kDevice && !chunk.allocated.contains(TierKind::kDevice)) {
    needs.push_back(TierKind::kDevice);
  }
  return needs;
}

}  // namespace tierd::daemon
