// RoomMaker on its own: a real host tier and ledger, and a record of the moves it asks for in place
// of the chunk service (whose moves run in nvme_service_test and device_service_test).
#include "daemon/chunks/room_maker.h"

#include <vector>

#include "absl/container/flat_hash_set.h"
#include "daemon/tiers/host_memory.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000, kBob = 2000;

// The moves RoomMaker asks for: a fetch reserves host space through the RoomMaker, as the
// service's does; a write-down only starts (the test settles it).
class RecordedMoves final : public RoomMaker::Moves {
 public:
  absl::Status StartFetch(ChunkMeta& chunk, TierKind tier, absl::Time) override {
    ++fetches;
    absl::StatusOr<Placement> p = room->ReserveIn(tier, chunk.tenant, chunk.size);
    if (!p.ok()) return p.status();
    chunk.placement[tier] = *p;
    chunk.allocated.insert(tier);
    return BeginMove(chunk, tier);
  }
  void StartWriteDown(ChunkMeta& chunk, TierKind) override {
    write_downs.push_back(chunk.id);
    EXPECT_TRUE(BeginMove(chunk, TierKind::kNvme).ok());
  }
  bool Awaited(ChunkId id, TierKind) const override { return awaited.contains(id); }
  void FailWaiters(ChunkId id, TierKind, const absl::Status& s) override {
    failed.emplace_back(id, s);
  }
  uint64_t moves_in_flight() const override { return write_downs.size(); }

  RoomMaker* room = nullptr;
  int fetches = 0;
  std::vector<ChunkId> write_downs;
  absl::flat_hash_set<ChunkId> awaited;
  std::vector<std::pair<ChunkId, absl::Status>> failed;
};

class RoomMakerTest : public testing::Test {
 protected:
  RoomMakerTest() {
    host_ = std::move(*CreateHostPool({.capacity = 4 * kSeg,
                                       .segment_size = kSeg,
                                       .huge_pages = HugePagePolicy::kNever,
                                       .lock_memory = false}));
  }

  // The room maker over the host tier, with (or without) a way down to NVMe.
  RoomMaker& Make(bool can_write_down, const Quotas& quotas = {}) {
    ledger_.Configure(Limits{}, quotas);
    Tiers tiers = NodeTiers(host_.get());
    if (can_write_down) tiers.hop[Path::kHostToNvme] = &unused_hop_;
    room_ = std::make_unique<RoomMaker>(chunks_, ledger_, tiers, moves_);
    moves_.room = room_.get();
    return *room_;
  }

  // A chunk filling one host segment: `clean` also has a (nominal) NVMe copy, else its host copy
  // is the only one.
  ChunkMeta& HostChunk(uint32_t tenant, uint64_t last_use, bool clean) {
    ChunkMeta& c = chunks_.Insert(tenant, "", /*persistent=*/false);
    c.size = kSeg;
    c.last_use = last_use;
    absl::StatusOr<Placement> p = room_->ReserveSpace(TierKind::kHost, tenant, kSeg);
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
    return c;
  }

  // A chunk whose only copy is on NVMe.
  ChunkMeta& NvmeChunk(uint32_t tenant) {
    ChunkMeta& c = chunks_.Insert(tenant, "", /*persistent=*/false);
    c.size = kSeg;
    c.allocated.insert(TierKind::kNvme);
    c.resident.insert(TierKind::kNvme);
    return c;
  }

  // Stand-ins for hops RoomMaker only looks for; never called.
  class UnusedHop final : public Hop {
   public:
    Path path() const override { return Path::kHostToNvme; }
    void Copy(const HopJob&, Done) override { ADD_FAILURE() << "RoomMaker copied"; }
  };

  std::unique_ptr<SegmentPool> host_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  RecordedMoves moves_;
  UnusedHop unused_hop_;
  std::unique_ptr<RoomMaker> room_;
};

TEST_F(RoomMakerTest, AFullTierDropsTheLeastRecentlyUsedCleanCopyAndNothingElse) {
  RoomMaker& room = Make(/*can_write_down=*/true);
  std::vector<ChunkMeta*> held;
  for (uint64_t use : {4, 1, 3, 2}) held.push_back(&HostChunk(kAlice, use, /*clean=*/true));
  absl::StatusOr<Placement> p = room.ReserveIn(TierKind::kHost, kAlice, kSeg);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(held[1]->resident.contains(TierKind::kHost));  // last used first
  EXPECT_TRUE(held[1]->resident.contains(TierKind::kNvme));   // its lower copy stays
  for (int i : {0, 2, 3}) EXPECT_TRUE(held[i]->resident.contains(TierKind::kHost)) << i;
  EXPECT_TRUE(moves_.write_downs.empty());  // dropping a clean copy moves nothing
}

TEST_F(RoomMakerTest, ATierFullOfDirtyCopiesWritesTheOldestDownAndQueuesTheFetchUntilItIsDone) {
  RoomMaker& room = Make(/*can_write_down=*/true);
  std::vector<ChunkMeta*> dirty;
  for (uint64_t use : {3, 1, 4, 2}) dirty.push_back(&HostChunk(kAlice, use, /*clean=*/false));
  ChunkMeta& wanted = NvmeChunk(kAlice);
  // Dirty copies are never dropped: a plain reservation finds no room.
  EXPECT_TRUE(absl::IsResourceExhausted(room.ReserveIn(TierKind::kHost, kAlice, kSeg).status()));

  ASSERT_TRUE(room.FetchOrQueue(wanted, TierKind::kHost, absl::Now()).ok());
  EXPECT_EQ(moves_.write_downs, std::vector<ChunkId>{dirty[1]->id});  // one frees enough
  EXPECT_EQ(wanted.state, ChunkState::kReady);                        // queued, not started
  EXPECT_EQ(moves_.fetches, 1);

  // Room coming: asking again neither writes more down nor queues the fetch twice.
  ASSERT_TRUE(room.FetchOrQueue(wanted, TierKind::kHost, absl::Now()).ok());
  EXPECT_EQ(moves_.write_downs.size(), 1u);

  // The write-down settles as the service's would: the copy below is current, the host copy goes.
  FinishMove(*dirty[1], true);
  room.DropCopy(*dirty[1], TierKind::kHost);
  room.MoveDone(dirty[1]->id);
  moves_.awaited.insert(wanted.id);
  room.RetryQueuedFetches();
  EXPECT_EQ(moves_.fetches, 3);
  EXPECT_EQ(wanted.state, ChunkState::kMoving);
  EXPECT_EQ(wanted.moving_to, TierKind::kHost);
  EXPECT_TRUE(moves_.failed.empty());
}

TEST_F(RoomMakerTest, AQueuedFetchNoOneWaitsForAnyMoreIsDropped) {
  RoomMaker& room = Make(/*can_write_down=*/true);
  std::vector<ChunkMeta*> dirty;
  for (uint64_t use : {1, 2, 3, 4}) dirty.push_back(&HostChunk(kAlice, use, /*clean=*/false));
  ChunkMeta& wanted = NvmeChunk(kAlice);
  ASSERT_TRUE(room.FetchOrQueue(wanted, TierKind::kHost, absl::Now()).ok());
  FinishMove(*dirty[0], true);
  room.DropCopy(*dirty[0], TierKind::kHost);
  room.MoveDone(dirty[0]->id);
  room.RetryQueuedFetches();  // its waiter gave up (not awaited)
  EXPECT_EQ(moves_.fetches, 1);
  EXPECT_EQ(wanted.state, ChunkState::kReady);
  moves_.awaited.insert(wanted.id);  // gone from the queue: a later retry does not start it
  room.RetryQueuedFetches();
  EXPECT_EQ(moves_.fetches, 1);
}

TEST_F(RoomMakerTest, WithNoTierBelowAFullTierOfDirtyCopiesRefusesTheFetch) {
  RoomMaker& room = Make(/*can_write_down=*/false);
  for (uint64_t use : {1, 2, 3, 4}) HostChunk(kAlice, use, /*clean=*/false);
  ChunkMeta& wanted = NvmeChunk(kAlice);
  absl::Status s = room.FetchOrQueue(wanted, TierKind::kHost, absl::Now());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(moves_.write_downs.empty());
}

TEST_F(RoomMakerTest, AUserAtItsQuotaMakesRoomOnlyFromItsOwnCopies) {
  Quotas quotas;
  quotas.per_uid[TierKind::kHost] = 2 * kSeg;
  RoomMaker& room = Make(/*can_write_down=*/true, quotas);
  ChunkMeta& bob_old = HostChunk(kBob, 1, /*clean=*/true);
  ChunkMeta& bob_older = HostChunk(kBob, 0, /*clean=*/true);
  ChunkMeta& alice_a = HostChunk(kAlice, 5, /*clean=*/true);
  ChunkMeta& alice_b = HostChunk(kAlice, 3, /*clean=*/true);
  absl::StatusOr<Placement> p = room.ReserveIn(TierKind::kHost, kAlice, kSeg);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(alice_b.resident.contains(TierKind::kHost));
  EXPECT_TRUE(alice_a.resident.contains(TierKind::kHost));
  EXPECT_TRUE(bob_old.resident.contains(TierKind::kHost));
  EXPECT_TRUE(bob_older.resident.contains(TierKind::kHost));
}

TEST_F(RoomMakerTest, WhileThePlannersMovesStartNothingIsDropped) {
  RoomMaker& room = Make(/*can_write_down=*/true);
  for (uint64_t use : {1, 2, 3, 4}) HostChunk(kAlice, use, /*clean=*/true);
  room.set_planning(true);
  EXPECT_TRUE(absl::IsResourceExhausted(room.ReserveIn(TierKind::kHost, kAlice, kSeg).status()));
  for (const auto& [id, c] : chunks_) EXPECT_TRUE(c.resident.contains(TierKind::kHost)) << id;
  room.set_planning(false);
  EXPECT_TRUE(room.ReserveIn(TierKind::kHost, kAlice, kSeg).ok());
}

}  // namespace
}  // namespace tierd::daemon
