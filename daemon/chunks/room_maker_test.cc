// RoomMaker over what it stands on, all real: a host tier, an NVMe region in a file, Space, the
// Mover and a WaitList; a listener settles moves as the chunk service does (room no longer coming,
// queued fetches retried).
#include "daemon/chunks/room_maker.h"

#include <memory>
#include <vector>

#include "daemon/chunks/batch.h"
#include "gtest/gtest.h"
#include "testing/scratch_tiers.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000;

class RoomMakerTest : public ::testing::Test, public Mover::Listener {
 protected:
  void TearDown() override {
    if (mover_ != nullptr) mover_->WaitForIdle();
    room_.reset();
    mover_.reset();
    space_.reset();
    rig_.reset();
  }

  // The room maker over the host tier, with (or without) NVMe below it to write down to.
  RoomMaker& Make(bool with_nvme) {
    ledger_.Configure(Limits{}, Quotas{});
    auto rig = testing::ScratchTiers::Make(
        {.segment_size = kSeg, .host_bytes = 4 * kSeg, .nvme_bytes = with_nvme ? 64u << 20 : 0});
    rig_ = std::move(rig).value();  // dies with the error when the tiers cannot be made
    const Tiers tiers = rig_->tiers();
    space_ = std::make_unique<Space>(chunks_, ledger_, tiers, Clock::Real());
    mover_ = std::make_unique<Mover>(mu_, chunks_, *space_, tiers, meter_, Clock::Real(), *this);
    room_ = std::make_unique<RoomMaker>(chunks_, ledger_, tiers, *space_, *mover_, waiters_,
                                        sessions_, Clock::Real());
    return *room_;
  }

  // A chunk filling one host segment whose host copy is the only one (dirty).
  ChunkMeta& DirtyHostChunk(uint64_t last_use) {
    ChunkMeta& c = chunks_.Insert(kAlice, "", /*persistent=*/false);
    c.size = kSeg;
    c.last_use = last_use;
    absl::StatusOr<Placement> p = space_->Reserve(TierKind::kHost, UserOwner(kAlice), kSeg);
    EXPECT_TRUE(p.ok()) << p.status();
    c.placement[TierKind::kHost] = *p;
    c.allocated.insert(TierKind::kHost);
    c.resident.insert(TierKind::kHost);
    c.dirty.insert(TierKind::kHost);
    chunks_.Reindex(c);
    return c;
  }

  // A chunk whose only copy is on NVMe (never written: it reads as zeros).
  ChunkMeta& NvmeChunk() {
    ChunkMeta& c = chunks_.Insert(kAlice, "", /*persistent=*/false);
    c.size = kSeg;
    if (rig_->nvme() != nullptr) {
      c.placement[TierKind::kNvme] = *space_->Reserve(TierKind::kNvme, UserOwner(kAlice), kSeg);
    }
    c.allocated.insert(TierKind::kNvme);
    c.resident.insert(TierKind::kNvme);
    chunks_.Reindex(c);
    return c;
  }

  // A request waiting for the chunk in the host tier, as the service records one.
  std::shared_ptr<Batch> Await(const ChunkMeta& c) {
    auto batch = std::make_shared<Batch>();
    batch->Add();
    waiters_.Add(c.id, Waiter{.batch = batch, .session = 1, .tier = TierKind::kHost});
    return batch;
  }

  // Settles as the chunk service does, with mu_ held: the room of a write-down is no longer
  // coming, and the fetches queued for room are tried again.
  void MoveSettled(ChunkMeta& chunk, const Mover::Settlement& settled) override {
    mu_.AssertHeld();
    EXPECT_TRUE(settled.status.ok()) << settled.status;
    settled_.push_back(chunk.id);
    room_->MoveDone(chunk.id);
    room_->RetryQueuedFetches();
  }

  std::unique_ptr<testing::ScratchTiers> rig_;
  absl::Mutex mu_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  PathMeter meter_;
  WaitList waiters_;
  SessionLedger sessions_;
  std::unique_ptr<Space> space_;
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<RoomMaker> room_;
  std::vector<ChunkId> settled_;
};

TEST_F(RoomMakerTest, ATierFullOfDirtyCopiesWritesTheOldestDownAndQueuesTheFetchUntilItIsDone) {
  RoomMaker& room = Make(/*with_nvme=*/true);
  std::vector<ChunkMeta*> dirty;
  ChunkMeta* wanted;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t use : {3, 1, 4, 2}) dirty.push_back(&DirtyHostChunk(use));
    wanted = &NvmeChunk();
    Await(*wanted);
    ASSERT_TRUE(room.FetchOrQueue(*wanted, TierKind::kHost, absl::Now()).ok());
    // The least recently used dirty copy is written down; one frees enough.
    EXPECT_EQ(dirty[1]->state, ChunkState::kMoving);
    EXPECT_EQ(dirty[1]->moving_to, TierKind::kNvme);
    for (int i : {0, 2, 3}) EXPECT_EQ(dirty[i]->state, ChunkState::kReady) << i;
    EXPECT_EQ(wanted->state, ChunkState::kReady);  // queued, not started
    // Room coming: asking again neither writes more down nor queues the fetch twice.
    ASSERT_TRUE(room.FetchOrQueue(*wanted, TierKind::kHost, absl::Now()).ok());
    for (int i : {0, 2, 3}) EXPECT_EQ(dirty[i]->state, ChunkState::kReady) << i;
  }
  mover_->WaitForIdle();  // the write-down settles, and the queued fetch runs in its room
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(settled_, (std::vector<ChunkId>{dirty[1]->id, wanted->id}));
  EXPECT_TRUE(dirty[1]->resident.contains(TierKind::kNvme));
  EXPECT_FALSE(dirty[1]->allocated.contains(TierKind::kHost));
  EXPECT_TRUE(wanted->resident.contains(TierKind::kHost));
}

TEST_F(RoomMakerTest, APairsUnreadVersionGoesDownBeforeOlderCopiesThatStay) {
  RoomMaker& room = Make(/*with_nvme=*/true);
  absl::MutexLock lock(&mu_);
  ChunkMeta& kept = DirtyHostChunk(1);  // state kept between steps, untouched since
  DirtyHostChunk(2);
  DirtyHostChunk(3);
  ChunkMeta& old_version = DirtyHostChunk(4);  // read by this step's forward, dead after it
  old_version.unread_version = true;
  ChunkMeta& fetch = NvmeChunk();
  Await(fetch);
  ASSERT_TRUE(room.FetchOrQueue(fetch, TierKind::kHost, absl::Now()).ok());
  EXPECT_EQ(old_version.state, ChunkState::kMoving);
  EXPECT_EQ(kept.state, ChunkState::kReady);
}

TEST_F(RoomMakerTest, ACopyAPrefetchWantsGoesDownAfterThoseNobodyWants) {
  RoomMaker& room = Make(/*with_nvme=*/true);
  absl::MutexLock lock(&mu_);
  ChunkMeta& wanted = DirtyHostChunk(1);  // the oldest, but wanted in a second
  Want(wanted, TierKind::kHost, absl::Now() + absl::Seconds(1), /*by_plan=*/false);
  ChunkMeta& unwanted = DirtyHostChunk(2);
  DirtyHostChunk(3);
  DirtyHostChunk(4);
  ChunkMeta& fetch = NvmeChunk();
  Await(fetch);
  ASSERT_TRUE(room.FetchOrQueue(fetch, TierKind::kHost, absl::Now()).ok());
  EXPECT_EQ(unwanted.state, ChunkState::kMoving);
  EXPECT_EQ(wanted.state, ChunkState::kReady);
}

TEST_F(RoomMakerTest, AQueuedFetchNoOneWaitsForAnyMoreIsDropped) {
  RoomMaker& room = Make(/*with_nvme=*/true);
  ChunkMeta* wanted;
  {
    absl::MutexLock lock(&mu_);
    for (uint64_t use : {1, 2, 3, 4}) DirtyHostChunk(use);
    wanted = &NvmeChunk();
    std::shared_ptr<Batch> request = Await(*wanted);
    ASSERT_TRUE(room.FetchOrQueue(*wanted, TierKind::kHost, absl::Now()).ok());
    waiters_.Forget(wanted->id, /*session=*/1);  // its waiter gave up before the room came
  }
  mover_->WaitForIdle();
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(settled_.size(), 1u);  // the write-down only
  EXPECT_EQ(wanted->state, ChunkState::kReady);
  EXPECT_FALSE(wanted->resident.contains(TierKind::kHost));
  Await(*wanted);  // gone from the queue: a later retry does not start it
  room.RetryQueuedFetches();
  EXPECT_EQ(wanted->state, ChunkState::kReady);
}

TEST_F(RoomMakerTest, WithNoTierBelowAFullTierOfDirtyCopiesRefusesTheFetch) {
  RoomMaker& room = Make(/*with_nvme=*/false);
  absl::MutexLock lock(&mu_);
  for (uint64_t use : {1, 2, 3, 4}) DirtyHostChunk(use);
  ChunkMeta& wanted = NvmeChunk();
  absl::Status s = room.FetchOrQueue(wanted, TierKind::kHost, absl::Now());
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  for (const auto& [id, c] : chunks_) EXPECT_EQ(c.state, ChunkState::kReady) << id;
  EXPECT_EQ(mover_->in_flight(), 0u);
}

}  // namespace
}  // namespace tierd::daemon
