// Space on its own: a real host tier and ledger.
#include "daemon/chunks/space.h"

#include <gtest/gtest.h>

#include <vector>

#include "daemon/tiers/host/host_memory.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000, kBob = 2000;

class SpaceTest : public testing::Test {
 protected:
  SpaceTest() {
    host_ = std::move(*CreateHostPool({.capacity = 4 * kSeg,
                                       .segment_size = kSeg,
                                       .huge_pages = HugePagePolicy::kNever,
                                       .lock_memory = false}));
  }

  Space& Make(const Quotas& quotas = {}) {
    ledger_.Configure(Limits{}, quotas);
    space_ = std::make_unique<Space>(chunks_, ledger_, NodeTiers(host_.get()), clock_);
    return *space_;
  }

  // A chunk filling one host segment; `clean` also has a (nominal) NVMe copy.
  ChunkMeta& HostChunk(uint32_t tenant, uint64_t last_use, bool clean) {
    ChunkMeta& c = chunks_.Insert(tenant, "", /*persistent=*/false);
    c.size = kSeg;
    c.last_use = last_use;
    absl::StatusOr<Placement> p = space_->Reserve(TierKind::kHost, UserOwner(tenant), kSeg);
    EXPECT_TRUE(p.ok()) << p.status();
    c.placement[TierKind::kHost] = *p;
    c.allocated.insert(TierKind::kHost);
    c.resident.insert(TierKind::kHost);
    if (clean) {
      c.allocated.insert(TierKind::kNvme);
      c.resident.insert(TierKind::kNvme);
    } else {
      c.dirty.insert(TierKind::kHost);
    }
    chunks_.Reindex(c);
    return c;
  }

  std::unique_ptr<SegmentPool> host_;
  FakeClock clock_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  std::unique_ptr<Space> space_;
};

TEST_F(SpaceTest, AFullTierDropsTheLeastRecentlyUsedCleanCopyAndNothingElse) {
  Space& space = Make();
  std::vector<ChunkMeta*> held;
  for (uint64_t use : {4, 1, 3, 2}) held.push_back(&HostChunk(kAlice, use, /*clean=*/true));
  absl::StatusOr<Placement> p = space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(held[1]->resident.contains(TierKind::kHost));  // last used first
  EXPECT_TRUE(held[1]->resident.contains(TierKind::kNvme));   // its lower copy stays
  for (int i : {0, 2, 3}) EXPECT_TRUE(held[i]->resident.contains(TierKind::kHost)) << i;
  EXPECT_EQ(ledger_.UsageOf(kAlice).bytes[TierKind::kHost], 4 * kSeg);  // one out, one in
}

TEST_F(SpaceTest, CopiesWantedSoonGoLastAndOfThemTheOneWantedLastGoesFirst) {
  Space& space = Make();
  const absl::Time now = clock_.Now();
  // The two least recently used are wanted (a Prefetch asked for one, a schedule needs the
  // other); the third is nobody's.
  ChunkMeta& asked = HostChunk(kAlice, 1, /*clean=*/true);
  ChunkMeta& scheduled = HostChunk(kAlice, 2, /*clean=*/true);
  ChunkMeta& nobodys = HostChunk(kAlice, 3, /*clean=*/true);
  ChunkMeta& recent = HostChunk(kAlice, 4, /*clean=*/true);
  Want(asked, TierKind::kHost, now + absl::Milliseconds(300), /*by_plan=*/false);
  Want(scheduled, TierKind::kHost, now + absl::Milliseconds(200), /*by_plan=*/true);

  ASSERT_TRUE(space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).ok());
  EXPECT_FALSE(nobodys.resident.contains(TierKind::kHost));  // unwanted, though used later
  EXPECT_TRUE(asked.resident.contains(TierKind::kHost));
  EXPECT_TRUE(scheduled.resident.contains(TierKind::kHost));

  // Only wanted copies and the recent one, which is wanted too now: the one wanted last goes.
  Want(recent, TierKind::kHost, now + absl::Milliseconds(100), /*by_plan=*/true);
  space.Release(kAlice, *space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg));
  EXPECT_FALSE(asked.resident.contains(TierKind::kHost));
  EXPECT_TRUE(scheduled.resident.contains(TierKind::kHost));
  EXPECT_TRUE(recent.resident.contains(TierKind::kHost));
}

TEST_F(SpaceTest, APairsVersionNoStepReadsGoesFirstThenTheLeastRecentlyUsed) {
  Space& space = Make();
  ChunkMeta& oldest = HostChunk(kAlice, 1, /*clean=*/true);
  ChunkMeta& unread = HostChunk(kAlice, 3, /*clean=*/true);
  ChunkMeta& older = HostChunk(kAlice, 2, /*clean=*/true);
  HostChunk(kAlice, 4, /*clean=*/true);
  unread.unread_version = true;  // as the last planning round saw the version bits
  absl::StatusOr<Placement> first = space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(unread.resident.contains(TierKind::kHost));
  EXPECT_TRUE(oldest.resident.contains(TierKind::kHost));
  absl::StatusOr<Placement> second = space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE(oldest.resident.contains(TierKind::kHost));  // then least recently used first
  EXPECT_TRUE(older.resident.contains(TierKind::kHost));
  space.Release(kAlice, *first);
  space.Release(kAlice, *second);
}

TEST_F(SpaceTest, AWantLapsesAfterItsGraceAndInAnotherTierCountsForNothing) {
  Space& space = Make();
  const absl::Time now = clock_.Now();
  ChunkMeta& lapsing = HostChunk(kAlice, 1, /*clean=*/true);
  ChunkMeta& elsewhere = HostChunk(kAlice, 2, /*clean=*/true);
  ChunkMeta& a = HostChunk(kAlice, 3, /*clean=*/true);
  ChunkMeta& b = HostChunk(kAlice, 4, /*clean=*/true);
  Want(lapsing, TierKind::kHost, now, /*by_plan=*/false);
  Want(elsewhere, TierKind::kDevice, now, /*by_plan=*/false);
  Want(a, TierKind::kHost, now + absl::Hours(1), /*by_plan=*/false);
  Want(b, TierKind::kHost, now + absl::Hours(1), /*by_plan=*/false);
  EXPECT_EQ(WantedAt(lapsing, TierKind::kHost, now + kWantedGrace), now);
  EXPECT_EQ(WantedAt(elsewhere, TierKind::kHost, now), absl::InfiniteFuture());

  // The want in the device tier does not keep the host copy.
  ASSERT_TRUE(space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).ok());
  EXPECT_FALSE(elsewhere.resident.contains(TierKind::kHost));
  // A client that never acquires what it asked for: once the grace is over it is nobody's.
  clock_.Advance(kWantedGrace + absl::Milliseconds(1));
  EXPECT_EQ(WantedAt(lapsing, TierKind::kHost, clock_.Now()), absl::InfiniteFuture());
  ASSERT_TRUE(space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).ok());
  EXPECT_FALSE(lapsing.resident.contains(TierKind::kHost));
  EXPECT_TRUE(a.resident.contains(TierKind::kHost));
  EXPECT_TRUE(b.resident.contains(TierKind::kHost));
}

TEST_F(SpaceTest, DirtyCopiesAreNeverDropped) {
  Space& space = Make();
  for (uint64_t use : {1, 2, 3, 4}) HostChunk(kAlice, use, /*clean=*/false);
  absl::Status s = space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  for (const auto& [id, c] : chunks_) EXPECT_TRUE(c.resident.contains(TierKind::kHost)) << id;
}

TEST_F(SpaceTest, AUserAtItsQuotaMakesRoomOnlyFromItsOwnCopies) {
  Quotas quotas;
  quotas.per_uid[TierKind::kHost] = 2 * kSeg;
  Space& space = Make(quotas);
  ChunkMeta& bob_old = HostChunk(kBob, 1, /*clean=*/true);
  ChunkMeta& bob_older = HostChunk(kBob, 0, /*clean=*/true);
  ChunkMeta& alice_a = HostChunk(kAlice, 5, /*clean=*/true);
  ChunkMeta& alice_b = HostChunk(kAlice, 3, /*clean=*/true);
  absl::StatusOr<Placement> p = space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(alice_b.resident.contains(TierKind::kHost));
  EXPECT_TRUE(alice_a.resident.contains(TierKind::kHost));
  EXPECT_TRUE(bob_old.resident.contains(TierKind::kHost));
  EXPECT_TRUE(bob_older.resident.contains(TierKind::kHost));
}

TEST_F(SpaceTest, WhileThePlannersMovesStartNothingIsDropped) {
  Space& space = Make();
  for (uint64_t use : {1, 2, 3, 4}) HostChunk(kAlice, use, /*clean=*/true);
  space.set_planning(true);
  EXPECT_TRUE(absl::IsResourceExhausted(
      space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).status()));
  for (const auto& [id, c] : chunks_) EXPECT_TRUE(c.resident.contains(TierKind::kHost)) << id;
  space.set_planning(false);
  EXPECT_TRUE(space.ReserveIn(TierKind::kHost, UserOwner(kAlice), kSeg).ok());
}

TEST(RoomNeededTest, AFetchToTheDeviceStagesThroughTheHostAndAnOverwriteNeedsOnlyItsLanding) {
  ChunkMeta c;
  c.allocated.insert(TierKind::kNvme);
  EXPECT_EQ(RoomNeeded(c, TierKind::kHost), std::vector<TierKind>{TierKind::kHost});
  EXPECT_EQ(RoomNeeded(c, TierKind::kDevice),
            (std::vector<TierKind>{TierKind::kHost, TierKind::kDevice}));
  EXPECT_EQ(RoomNeeded(c, TierKind::kDevice, Access::kOverwrite),
            std::vector<TierKind>{TierKind::kDevice});
  c.allocated.insert(TierKind::kHost);
  EXPECT_EQ(RoomNeeded(c, TierKind::kDevice), std::vector<TierKind>{TierKind::kDevice});
}

}  // namespace
}  // namespace tierd::daemon
