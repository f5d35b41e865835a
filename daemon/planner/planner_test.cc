// The planner's decisions, given capacities, bandwidths and schedules (daemon/planner/planner.h).
#include "daemon/planner/planner.h"

#include <algorithm>
#include <random>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;
const absl::Time kNow = absl::FromUnixSeconds(1'000'000);

using Kind = PlannedMove::Kind;

// A node with a host tier of `host_chunks` 1 MiB chunks, NVMe, and a 1 GB/s path each way.
class PlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    in_.now = kNow;
    in_.capacity[TierKind::kNvme] = 1024 * kMiB;
    in_.bytes_per_second.fill(1e9);
  }

  void HostCapacity(uint64_t chunks) {
    in_.capacity[TierKind::kHost] = chunks * kMiB;
    Refresh();
  }

  // A chunk of 1 MiB on NVMe (home), also resident where `resident` says.
  PlannerChunk& Chunk(ChunkId id, std::initializer_list<TierKind> resident = {}) {
    PlannerChunk c{.id = id, .size = kMiB, .owner = 1, .home = TierKind::kNvme};
    c.resident.insert(TierKind::kNvme);
    for (TierKind t : resident) c.resident.insert(t);
    c.last_use = id;
    PlannerChunk& stored = in_.chunks[id] = c;
    Refresh();
    return stored;
  }

  // Free space = capacity - what the chunks hold.
  void Refresh() {
    for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
      uint64_t used = 0;
      for (const auto& [id, c] : in_.chunks) {
        if (c.resident.contains(t) || (c.moving && c.moving_to == t)) used += c.size;
      }
      const uint64_t cap = in_.capacity[t];
      in_.free[t] = cap > used ? cap - used : 0;
    }
  }

  // Session 1 runs `steps`, one step per `step` of time; `cursor` steps have started, the last
  // one just now.
  void Schedule(std::vector<std::vector<ScheduledAccess>> steps, uint64_t cursor,
                absl::Duration step = absl::Milliseconds(10)) {
    steps_ = std::move(steps);
    times_.assign(steps_.size(), step);
    in_.sessions = {SessionPlan{.session = 1,
                                .steps = &steps_,
                                .cursor = cursor,
                                .step_started = kNow,
                                .step_time = &times_}};
  }

  static std::vector<ScheduledAccess> Read(std::initializer_list<ChunkId> ids,
                                           TierKind tier = TierKind::kHost) {
    std::vector<ScheduledAccess> out;
    for (ChunkId id : ids) out.push_back({id, tier, Access::kRead});
    return out;
  }

  static std::vector<PlannedMove> Only(const std::vector<PlannedMove>& moves, Kind kind) {
    std::vector<PlannedMove> out;
    for (const PlannedMove& m : moves) {
      if (m.kind == kind) out.push_back(m);
    }
    return out;
  }

  PlanInput in_;
  std::vector<std::vector<ScheduledAccess>> steps_;
  std::vector<absl::Duration> times_;
};

TEST_F(PlannerTest, FetchesTheNextStepsChunksWhenTheyAreDue) {
  HostCapacity(8);
  Chunk(1);
  Chunk(2);
  Schedule({Read({1}), Read({2})}, /*cursor=*/0);
  std::vector<PlannedMove> moves = Plan(in_);
  ASSERT_EQ(moves.size(), 1u);  // step 0 is due now; step 1 in 10 ms, 1 MiB takes 1.25 ms
  EXPECT_EQ(moves[0].kind, Kind::kFetch);
  EXPECT_EQ(moves[0].id, 1u);
  EXPECT_EQ(moves[0].tier, TierKind::kHost);
  EXPECT_EQ(moves[0].deadline, kNow);
}

TEST_F(PlannerTest, StartsAsLateAsIsSafeAndNoLater) {
  HostCapacity(8);
  Chunk(1, {TierKind::kHost});
  Chunk(2);
  // Chunk 2 is needed when step 1 starts, 10 ms from now; its transfer takes 1.25 ms.
  Schedule({Read({1}), Read({2})}, /*cursor=*/1, absl::Milliseconds(10));
  EXPECT_TRUE(Plan(in_).empty()) << "too early: it would hold space for nothing";
  // Its latest safe start is 10 - 1.25 = 8.75 ms; it starts once that is within the 2 ms lead.
  in_.now = kNow + absl::Microseconds(6500);
  EXPECT_TRUE(Plan(in_).empty());
  in_.now = kNow + absl::Milliseconds(7);
  std::vector<PlannedMove> moves = Plan(in_);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].id, 2u);
}

TEST_F(PlannerTest, APathsLatencyAndTheBytesInFlightOnItStartATransferThatMuchEarlier) {
  HostCapacity(8);
  Chunk(1, {TierKind::kHost});
  Chunk(2);
  Schedule({Read({1}), Read({2})}, /*cursor=*/1, absl::Milliseconds(10));
  // Chunk 2's bytes take 1.05 ms and the path's latency is 2 ms, both planned 1.25 times as long:
  // its latest safe start is 10 - 3.81 = 6.19 ms, within the 2 ms lead from 4.19 ms on.
  in_.latency[Path::kNvmeToHost] = absl::Milliseconds(2);
  in_.now = kNow + absl::Milliseconds(4);
  EXPECT_TRUE(Plan(in_).empty());
  in_.now = kNow + absl::Microseconds(4500);
  EXPECT_EQ(Only(Plan(in_), Kind::kFetch).size(), 1u);
  // 2 MiB already in flight on the path (2.1 ms) go first: from 2.09 ms on.
  in_.now = kNow + absl::Microseconds(2500);
  EXPECT_TRUE(Plan(in_).empty());
  in_.queued_bytes[Path::kNvmeToHost] = 2 * kMiB;
  EXPECT_EQ(Only(Plan(in_), Kind::kFetch).size(), 1u);
}

TEST_F(PlannerTest, TransfersSharingAPathAreLaidOutBackwardsFromTheirDeadlines) {
  HostCapacity(16);
  for (ChunkId id = 1; id <= 9; ++id) Chunk(id);
  // Eight chunks needed at the start of step 1, 10 ms away: 8 x 1.25 ms = 10 ms of transfers, so
  // the first must start now although its own transfer is short.
  Schedule({Read({9}), Read({1, 2, 3, 4, 5, 6, 7, 8})}, /*cursor=*/1);
  in_.chunks[9].resident.insert(TierKind::kHost);
  Refresh();
  std::vector<PlannedMove> moves = Only(Plan(in_), Kind::kFetch);
  // Backwards from 10 ms: chunk 8 starts at 8.75 ms, ..., chunk 2 at 1.25, chunk 1 at 0. Those due
  // within the 2 ms lead start now.
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].id, 1u);
  EXPECT_EQ(moves[1].id, 2u);
}

TEST_F(PlannerTest, EvictsTheCopyNeededFurthestInTheFutureFirstAndUnscheduledOnesBeforeThat) {
  HostCapacity(3);
  Chunk(1, {TierKind::kHost});  // next needed at step 3
  Chunk(2, {TierKind::kHost});  // next needed at step 2
  Chunk(3, {TierKind::kHost});  // not in the schedule
  Chunk(4);                     // needed now
  Chunk(5);                     // needed at step 1
  Schedule({Read({4}), Read({5}), Read({2}), Read({1})}, /*cursor=*/0, absl::Microseconds(100));
  std::vector<PlannedMove> moves = Plan(in_);
  std::vector<PlannedMove> drops = Only(moves, Kind::kDrop);
  ASSERT_EQ(drops.size(), 2u);
  EXPECT_EQ(drops[0].id, 3u);  // unscheduled
  EXPECT_EQ(drops[1].id, 1u);  // needed at step 3, after chunk 2
  std::vector<PlannedMove> fetches = Only(moves, Kind::kFetch);
  ASSERT_EQ(fetches.size(), 2u);
  EXPECT_EQ(fetches[0].id, 4u);
  EXPECT_EQ(fetches[1].id, 5u);
}

TEST_F(PlannerTest, APairsVersionNoStepReadsGoesBeforeOtherCopiesNoScheduleNeeds) {
  HostCapacity(2);
  Chunk(1, {TierKind::kHost});                        // nobody's, used longest ago
  Chunk(2, {TierKind::kHost}).unread_version = true;  // waits for the next step's new weights
  Chunk(3);
  Schedule({Read({3})}, /*cursor=*/0);
  std::vector<PlannedMove> drops = Only(Plan(in_), Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0].id, 2u);
}

TEST_F(PlannerTest, HeadroomStaysFreeAndFetchesThatWouldTakeItDropCopiesNeededLaterInstead) {
  HostCapacity(5);
  Chunk(1, {TierKind::kHost});  // needed now
  Chunk(2);                     // needed at step 1
  Chunk(3);                     // needed at step 2
  Chunk(4, {TierKind::kHost});  // needed at step 3
  Schedule({Read({1}), Read({2}), Read({3}), Read({4})}, /*cursor=*/0, absl::Microseconds(100));
  // 3 MiB free: both fetches fit.
  EXPECT_TRUE(Only(Plan(in_), Kind::kDrop).empty());
  EXPECT_EQ(Only(Plan(in_), Kind::kFetch).size(), 2u);
  // With 2 MiB of it kept for copies placed outside a plan, the second fetch takes the room of
  // the copy needed last, and the headroom stays free.
  in_.headroom[TierKind::kHost] = 2 * kMiB;
  const std::vector<PlannedMove> moves = Plan(in_);
  const std::vector<PlannedMove> drops = Only(moves, Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0].id, 4u);
  ASSERT_EQ(Only(moves, Kind::kFetch).size(), 2u);
  // With 3 MiB kept, only what is needed later than a fetch makes room for it: chunk 3 waits.
  in_.headroom[TierKind::kHost] = 3 * kMiB;
  const std::vector<PlannedMove> fewer = Only(Plan(in_), Kind::kFetch);
  ASSERT_EQ(fewer.size(), 1u);
  EXPECT_EQ(fewer[0].id, 2u);
}

TEST_F(PlannerTest, NeverDisplacesACopyNeededSoonerThanTheIncomingOne) {
  HostCapacity(1);
  Chunk(1, {TierKind::kHost});  // needed at step 1
  Chunk(2);                     // needed at step 2
  Schedule({Read({1}), Read({1}), Read({2})}, /*cursor=*/1, absl::Microseconds(100));
  EXPECT_TRUE(Only(Plan(in_), Kind::kDrop).empty());
  EXPECT_TRUE(Only(Plan(in_), Kind::kFetch).empty());
}

TEST_F(PlannerTest, ACopyAPrefetchAskedForIsNeededWhenItWasAskedFor) {
  HostCapacity(2);
  // Another session's read-ahead, not in any schedule: asked for in 250 us, and asked for in 50 ms.
  Chunk(1, {TierKind::kHost}).asked = kNow + absl::Microseconds(250);
  Chunk(2, {TierKind::kHost}).asked = kNow + absl::Milliseconds(50);
  Chunk(3);  // needed at step 2, 200 us from now
  Schedule({{}, {}, Read({3})}, /*cursor=*/1, absl::Microseconds(100));
  std::vector<PlannedMove> moves = Plan(in_);
  // Neither goes first as an unscheduled copy would (least recently used: chunk 1): the one
  // asked for after chunk 3's use goes, and the one asked for before it stays.
  std::vector<PlannedMove> drops = Only(moves, Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0].id, 2u);

  // What room made outside a plan ranks copies by: the same next uses.
  std::vector<NextUse> uses;
  Plan(in_, &uses);
  std::sort(uses.begin(), uses.end(),
            [](const NextUse& a, const NextUse& b) { return a.id < b.id; });
  ASSERT_EQ(uses.size(), 2u);  // chunk 3 has no copy above NVMe yet
  EXPECT_EQ(uses[0], (NextUse{1, TierKind::kHost, kNow + absl::Microseconds(250)}));
  EXPECT_EQ(uses[1], (NextUse{2, TierKind::kHost, kNow + absl::Milliseconds(50)}));
}

TEST_F(PlannerTest, NextUsesAreTheSchedulesFirstUseOfEachCopyAndNoneForAnOverwrite) {
  HostCapacity(8);
  Chunk(1, {TierKind::kHost});
  Chunk(2, {TierKind::kHost});
  Chunk(3, {TierKind::kHost});  // unscheduled
  Chunk(4, {TierKind::kHost});  // about to be overwritten
  Schedule({Read({1}), Read({2}), {{4, TierKind::kHost, Access::kOverwrite}}, Read({1})},
           /*cursor=*/1, absl::Milliseconds(10));
  std::vector<NextUse> uses;
  Plan(in_, &uses);
  std::sort(uses.begin(), uses.end(),
            [](const NextUse& a, const NextUse& b) { return a.id < b.id; });
  ASSERT_EQ(uses.size(), 4u);
  EXPECT_EQ(uses[0].when, kNow);  // the running step's
  EXPECT_EQ(uses[1].when, kNow + absl::Milliseconds(10));
  EXPECT_EQ(uses[2].when, absl::InfiniteFuture());
  EXPECT_EQ(uses[3].when, absl::InfiniteFuture());
}

TEST_F(PlannerTest, PinnedAndMovingCopiesAreNeverEvicted) {
  HostCapacity(2);
  Chunk(1, {TierKind::kHost}).pinned = true;
  PlannerChunk& moving = Chunk(2, {TierKind::kHost});
  moving.moving = true;
  moving.moving_to = TierKind::kNvme;
  Chunk(3);
  Schedule({Read({3})}, /*cursor=*/0);
  std::vector<PlannedMove> moves = Plan(in_);
  EXPECT_TRUE(moves.empty()) << "nothing may make room for chunk 3";
}

TEST_F(PlannerTest, DirtyCopiesAreWrittenBackBeforeTheirSpaceIsReused) {
  HostCapacity(1);
  PlannerChunk& dirty = Chunk(1, {TierKind::kHost});
  dirty.resident.erase(TierKind::kNvme);  // written on the host since: the NVMe copy is stale
  dirty.dirty.insert(TierKind::kHost);
  Chunk(2);
  Schedule({Read({2})}, /*cursor=*/0);
  std::vector<PlannedMove> moves = Plan(in_);
  EXPECT_TRUE(Only(moves, Kind::kDrop).empty());
  EXPECT_TRUE(Only(moves, Kind::kFetch).empty());
  std::vector<PlannedMove> wb = Only(moves, Kind::kWriteBack);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wb[0].id, 1u);
  EXPECT_EQ(wb[0].tier, TierKind::kHost);
  // Once written back (clean), its space goes to chunk 2.
  in_.chunks[1].resident.insert(TierKind::kNvme);
  in_.chunks[1].dirty = TierSet();
  moves = Plan(in_);
  ASSERT_EQ(Only(moves, Kind::kDrop).size(), 1u);
  ASSERT_EQ(Only(moves, Kind::kFetch).size(), 1u);
  EXPECT_EQ(Only(moves, Kind::kFetch)[0].id, 2u);
}

TEST_F(PlannerTest, ADirtyCopyPlacedOutsideAPlanIsItsClientsToSendDownButOnceCleanItMayGo) {
  HostCapacity(1);
  PlannerChunk& grads = Chunk(1, {TierKind::kHost});  // an Acquire wrote it on the host
  grads.resident.erase(TierKind::kNvme);
  grads.dirty.insert(TierKind::kHost);
  grads.unplanned.insert(TierKind::kHost);
  grads.transient = true;  // as tierd.torch makes them: not written down early either
  Chunk(2);
  Schedule({Read({2})}, /*cursor=*/0);
  EXPECT_TRUE(Plan(in_).empty()) << "the plan does not write it down for room";
  // Sent down by its client (clean now), its room may go to the fetch.
  in_.chunks[1].resident.insert(TierKind::kNvme);
  in_.chunks[1].dirty = TierSet();
  const std::vector<PlannedMove> moves = Plan(in_);
  ASSERT_EQ(Only(moves, Kind::kDrop).size(), 1u);
  EXPECT_EQ(Only(moves, Kind::kDrop)[0].id, 1u);
  ASSERT_EQ(Only(moves, Kind::kFetch).size(), 1u);
}

TEST_F(PlannerTest, DirtyCopiesNotNeededForAWhileAreWrittenBackEarlyWhenThePathIsIdle) {
  HostCapacity(4);
  PlannerChunk& grad = Chunk(1, {TierKind::kHost});
  grad.resident.erase(TierKind::kNvme);
  grad.dirty.insert(TierKind::kHost);
  Chunk(2, {TierKind::kHost});
  in_.headroom[TierKind::kHost] = 2 * kMiB;  // copies placed outside a plan want the free room
  Schedule({Read({2}), Read({2}), Read({1})}, /*cursor=*/1, absl::Milliseconds(10));
  std::vector<PlannedMove> wb = Only(Plan(in_), Kind::kWriteBack);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wb[0].id, 1u);
  in_.queued_bytes[Path::kHostToNvme] = kMiB;  // the path is busy
  EXPECT_TRUE(Only(Plan(in_), Kind::kWriteBack).empty());
}

TEST_F(PlannerTest, AScratchCopyIsWrittenBackEarlyOnlyWhenItsTierIsShortOfCleanRoom) {
  HostCapacity(4);
  PlannerChunk& state = Chunk(1, {TierKind::kHost});  // optimizer state stepped on the host
  state.resident.erase(TierKind::kNvme);
  state.dirty.insert(TierKind::kHost);
  Chunk(2, {TierKind::kHost});  // the schedule's
  Chunk(3, {TierKind::kHost});  // clean, and nothing needs it: room for the taking
  Schedule({Read({2}), Read({2})}, /*cursor=*/1, absl::Milliseconds(10));
  // Beyond the 1 MiB headroom kept free, chunk 3 could give as much again: no write is needed
  // yet, and the copy may well be rewritten before it would be dropped.
  in_.headroom[TierKind::kHost] = kMiB;
  EXPECT_TRUE(Only(Plan(in_), Kind::kWriteBack).empty());
  // A persistent chunk's copy goes down all the same: its durable version is brought up to date.
  in_.chunks[1].persistent = true;
  ASSERT_EQ(Only(Plan(in_), Kind::kWriteBack).size(), 1u);
  in_.chunks[1].persistent = false;
  // Copies placed outside a plan held 2 MiB more lately: the clean room falls short, and the
  // copy goes down while the path is idle, so that dropping it later costs nothing.
  in_.headroom[TierKind::kHost] = 2 * kMiB;
  std::vector<PlannedMove> wb = Only(Plan(in_), Kind::kWriteBack);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wb[0].id, 1u);
  // So too when a fetch the schedule needs finds no room: chunk 1, placed outside a plan, is
  // not the plan's to write down for room, but it goes down early.
  in_.headroom[TierKind::kHost] = 0;
  in_.chunks[1].unplanned.insert(TierKind::kHost);
  in_.chunks[3].pinned = true;
  Chunk(4);
  Chunk(5);
  Schedule({Read({2}), Read({2, 4, 5})}, /*cursor=*/1, absl::Milliseconds(10));
  wb = Only(Plan(in_), Kind::kWriteBack);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wb[0].id, 1u);
}

TEST_F(PlannerTest, TransientCopiesAreWrittenBackOnlyWhenTheirSpaceIsNeeded) {
  HostCapacity(2);
  PlannerChunk& grad = Chunk(1, {TierKind::kHost});
  grad.resident.erase(TierKind::kNvme);
  grad.dirty.insert(TierKind::kHost);
  grad.transient = true;
  Chunk(2, {TierKind::kHost});
  Chunk(3);
  // Not needed for a while and the path idle: a transient copy stays where it is.
  Schedule({Read({2}), Read({2}), Read({2})}, /*cursor=*/1, absl::Milliseconds(10));
  EXPECT_TRUE(Only(Plan(in_), Kind::kWriteBack).empty());
  // Its space is wanted (chunk 3 is due and the tier is full): it goes down first.
  Schedule({Read({2}), Read({2, 3})}, /*cursor=*/0, absl::Milliseconds(10));
  std::vector<PlannedMove> wb = Only(Plan(in_), Kind::kWriteBack);
  ASSERT_EQ(wb.size(), 1u);
  EXPECT_EQ(wb[0].id, 1u);
}

TEST_F(PlannerTest, AFetchToTheDeviceFromNvmeNeedsRoomInBothTiers) {
  HostCapacity(1);
  in_.capacity[TierKind::kDevice] = 4 * kMiB;
  Chunk(1, {TierKind::kHost}).pinned = true;
  Chunk(2);
  Refresh();
  Schedule({Read({2}, TierKind::kDevice)}, /*cursor=*/0);
  EXPECT_TRUE(Plan(in_).empty()) << "no host room to stage chunk 2 in";
  in_.chunks[1].pinned = false;
  std::vector<PlannedMove> moves = Plan(in_);
  ASSERT_EQ(Only(moves, Kind::kFetch).size(), 1u);
  EXPECT_EQ(Only(moves, Kind::kFetch)[0].tier, TierKind::kDevice);
  EXPECT_EQ(Only(moves, Kind::kDrop).size(), 1u);
}

TEST_F(PlannerTest, AHostCopyStagedForTheDeviceIsNotKeptOnceTheDeviceHoldsTheChunk) {
  // Chunk 1 is used next in the device, which holds it: its host copy serves nothing. Chunk 2 is
  // used next in the host, later than chunk 1 in the device. Room for chunk 3 comes from chunk 1.
  HostCapacity(2);
  in_.capacity[TierKind::kDevice] = 4 * kMiB;
  Chunk(1, {TierKind::kHost, TierKind::kDevice});
  Chunk(2, {TierKind::kHost});
  Chunk(3);
  Schedule({Read({3}), Read({1}, TierKind::kDevice), Read({2})}, /*cursor=*/0);
  std::vector<PlannedMove> drops = Only(Plan(in_), Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0], (PlannedMove{Kind::kDrop, 1, TierKind::kHost}));
  // Without the device copy the host copy is the source of the device's fetch: it stays.
  in_.chunks[1].resident.erase(TierKind::kDevice);
  Refresh();
  drops = Only(Plan(in_), Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0], (PlannedMove{Kind::kDrop, 2, TierKind::kHost}));
}

TEST_F(PlannerTest, FreeSpaceInPiecesBringsSparesInEveryTierTheFetchNeedsRoomIn) {
  // Room for the fetch by the count in both tiers, but not in one piece: a fetch to the device
  // from NVMe stages through the host, so each tier gets spares, the copies needed latest, and
  // never one needed before the fetch or one that exists nowhere else.
  HostCapacity(4);
  in_.capacity[TierKind::kDevice] = 4 * kMiB;
  Chunk(1, {TierKind::kHost, TierKind::kDevice});  // needed after chunk 5
  Chunk(2, {TierKind::kHost});                     // needed in the host before chunk 5
  Chunk(6, {TierKind::kDevice});                   // needed in the device before chunk 5
  PlannerChunk& only_copy = Chunk(3, {TierKind::kHost, TierKind::kDevice});
  only_copy.resident.erase(TierKind::kHost);
  only_copy.resident.erase(TierKind::kNvme);
  only_copy.dirty.insert(TierKind::kDevice);
  Chunk(4, {TierKind::kHost});  // unscheduled
  Chunk(5);
  in_.largest_free[TierKind::kHost] = kMiB / 2;
  in_.largest_free[TierKind::kNvme] = 0;
  in_.largest_free[TierKind::kDevice] = kMiB / 2;
  std::vector<ScheduledAccess> first = Read({2});
  first.push_back({6, TierKind::kDevice, Access::kRead});
  Schedule({first, Read({5}, TierKind::kDevice), Read({1, 3}, TierKind::kDevice)},
           /*cursor=*/0, absl::Milliseconds(1));
  std::vector<PlannedMove> moves = Plan(in_);
  ASSERT_EQ(Only(moves, Kind::kFetch).size(), 1u);
  EXPECT_EQ(Only(moves, Kind::kFetch)[0].id, 5u);
  std::vector<PlannedMove> spares = Only(moves, Kind::kSpare);
  auto spare = [&](ChunkId id, TierKind tier) {
    return std::find(spares.begin(), spares.end(), PlannedMove{Kind::kSpare, id, tier}) !=
           spares.end();
  };
  EXPECT_TRUE(spare(4, TierKind::kHost)) << "unscheduled: first in the host";
  EXPECT_TRUE(spare(1, TierKind::kHost));
  EXPECT_TRUE(spare(1, TierKind::kDevice));
  EXPECT_FALSE(spare(2, TierKind::kHost)) << "needed before the fetch";
  EXPECT_FALSE(spare(6, TierKind::kDevice)) << "needed before the fetch";
  EXPECT_FALSE(spare(3, TierKind::kDevice)) << "the only copy";
  // Spares follow their fetch.
  const auto fetch = std::find_if(moves.begin(), moves.end(),
                                  [](const PlannedMove& m) { return m.kind == Kind::kFetch; });
  for (auto it = moves.begin(); it != fetch; ++it) EXPECT_NE(it->kind, Kind::kSpare);
}

TEST_F(PlannerTest, AnOverwriteGetsRoomAheadButNothingIsFetched) {
  HostCapacity(2);
  Chunk(1, {TierKind::kHost});  // needed after the overwrite
  Chunk(2, {TierKind::kHost});  // needed after the overwrite
  Chunk(3);
  std::vector<ScheduledAccess> overwrite = {{3, TierKind::kHost, Access::kOverwrite}};
  Schedule({Read({}), overwrite, Read({1}), Read({2})}, /*cursor=*/0, absl::Milliseconds(50));
  std::vector<PlannedMove> moves = Plan(in_);
  EXPECT_TRUE(Only(moves, Kind::kFetch).empty());
  std::vector<PlannedMove> drops = Only(moves, Kind::kDrop);
  ASSERT_EQ(drops.size(), 1u);
  EXPECT_EQ(drops[0].id, 2u) << "the copy needed last";
}

TEST_F(PlannerTest, AUseAfterAWriteElsewhereWaitsForTheWriteAndCopiesAboutToBeOverwrittenGoFirst) {
  // Chunk 1 is overwritten on the device in step 1 and read in the host in step 2: the host read
  // wants the new contents, so its old copy on NVMe is not fetched now. Chunk 2's host copy is
  // overwritten in step 1: it is needed by nobody and goes before chunk 3's, needed in step 3.
  HostCapacity(2);
  in_.capacity[TierKind::kDevice] = 4 * kMiB;
  Chunk(1);
  Chunk(2, {TierKind::kHost});
  Chunk(3, {TierKind::kHost});
  Chunk(4);
  std::vector<ScheduledAccess> writes = {{1, TierKind::kDevice, Access::kOverwrite},
                                         {2, TierKind::kHost, Access::kOverwrite}};
  Schedule({Read({4}), writes, Read({1}), Read({3})}, /*cursor=*/0);
  std::vector<PlannedMove> moves = Plan(in_);
  std::vector<PlannedMove> fetches = Only(moves, Kind::kFetch);
  ASSERT_EQ(fetches.size(), 1u);
  EXPECT_EQ(fetches[0].id, 4u);
  std::vector<PlannedMove> drops = Only(moves, Kind::kDrop);
  ASSERT_FALSE(drops.empty());
  EXPECT_EQ(drops[0], (PlannedMove{Kind::kDrop, 2, TierKind::kHost}));
}

TEST_F(PlannerTest, ASessionOverItsQuotaWaitsWhileAnotherIsServed) {
  HostCapacity(8);
  Chunk(1, {TierKind::kHost});
  Chunk(2);
  PlannerChunk& theirs = Chunk(3);
  theirs.owner = 2;
  std::vector<std::vector<ScheduledAccess>> mine = {Read({1, 2})};
  std::vector<std::vector<ScheduledAccess>> other = {Read({3})};
  std::vector<absl::Duration> t = {absl::Milliseconds(10)};
  in_.sessions = {
      SessionPlan{.session = 1, .steps = &mine, .cursor = 0, .step_started = kNow, .step_time = &t},
      SessionPlan{
          .session = 2, .steps = &other, .cursor = 0, .step_started = kNow, .step_time = &t}};
  in_.sessions[0].quota[TierKind::kHost] = kMiB;  // holds chunk 1 already
  std::vector<PlannedMove> fetches = Only(Plan(in_), Kind::kFetch);
  ASSERT_EQ(fetches.size(), 1u);
  EXPECT_EQ(fetches[0].id, 3u);
  EXPECT_EQ(fetches[0].session, 2u);
}

// Over random schedules and states: the planned fetches never overfill a tier (counting the drops
// planned with them), never touch pinned or moving chunks, and never drop a dirty copy.
TEST_F(PlannerTest, RandomSchedulesNeverOverfillATierOrDropWhatMustStay) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 300; ++round) {
    in_ = PlanInput{};
    SetUp();
    const uint64_t cap = 2 + rng() % 8;
    in_.capacity[TierKind::kDevice] = (rng() % 4) * kMiB;
    const int chunks = 4 + static_cast<int>(rng() % 16);
    for (ChunkId id = 1; id <= static_cast<ChunkId>(chunks); ++id) {
      PlannerChunk c{.id = id, .size = kMiB * (1 + rng() % 2), .owner = 1, .home = TierKind::kNvme};
      c.resident.insert(TierKind::kNvme);
      c.last_use = rng() % 100;
      in_.chunks[id] = c;
    }
    // Fill the host up to its capacity with some of them, some dirty, pinned or moving.
    in_.capacity[TierKind::kHost] = cap * kMiB;
    uint64_t used = 0;
    for (auto& [id, c] : in_.chunks) {
      if (rng() % 2 == 0 || used + c.size > cap * kMiB) continue;
      c.resident.insert(TierKind::kHost);
      used += c.size;
      if (rng() % 4 == 0) {
        c.resident.erase(TierKind::kNvme);
        c.dirty.insert(TierKind::kHost);
      }
      c.pinned = rng() % 5 == 0;
      c.moving = !c.pinned && rng() % 7 == 0;
      c.moving_to = TierKind::kNvme;
    }
    Refresh();
    std::vector<std::vector<ScheduledAccess>> steps(1 + rng() % 6);
    for (auto& step : steps) {
      for (int k = 0; k < 3; ++k) {
        step.push_back({1 + rng() % chunks, rng() % 4 == 0 ? TierKind::kDevice : TierKind::kHost,
                        Access::kRead});
      }
    }
    Schedule(steps, rng() % 10, absl::Microseconds(50 + rng() % 2000));
    std::vector<PlannedMove> moves = Plan(in_);

    TierArray<int64_t> free;
    for (TierKind t : kAllTiers) free[t] = static_cast<int64_t>(in_.free[t]);
    for (const PlannedMove& m : moves) {
      const PlannerChunk& c = in_.chunks.at(m.id);
      EXPECT_FALSE(c.pinned) << "round " << round;
      EXPECT_FALSE(c.moving) << "round " << round;
      const TierKind t = m.tier;
      switch (m.kind) {
        case Kind::kSpare:  // only with free space in pieces, which this test does not model
          ADD_FAILURE() << "a spare without fragmentation";
          break;
        case Kind::kDrop:
          EXPECT_TRUE(c.resident.contains(m.tier));
          EXPECT_FALSE(c.dirty.contains(m.tier)) << "round " << round;
          free[t] += static_cast<int64_t>(c.size);
          break;
        case Kind::kFetch:
          free[t] -= static_cast<int64_t>(c.size);
          if (m.tier == TierKind::kDevice && !c.resident.contains(TierKind::kHost)) {
            free[TierKind::kHost] -= static_cast<int64_t>(c.size);
          }
          break;
        case Kind::kWriteBack:
          EXPECT_FALSE(c.dirty.empty() && c.resident.contains(TierKind::kNvme))
              << "round " << round << ": nothing to write back";
          break;
      }
      for (TierKind k : kAllTiers) {
        EXPECT_GE(free[k], 0) << "round " << round << ": tier " << TierName(k) << " overfilled";
      }
    }
  }
}

}  // namespace
}  // namespace tierd::daemon
