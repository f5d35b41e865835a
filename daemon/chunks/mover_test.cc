// The Mover on its own, over real tiers and hops (a host pool, an NVMe region in a file, the
// emulated GPU), with a listener that records what it is told in place of the chunk service.
#include "daemon/chunks/mover.h"

#include <vector>

#include "absl/synchronization/notification.h"
#include "daemon/chunks/batch.h"
#include "gtest/gtest.h"
#include "testing/scratch_tiers.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 8 << 20;
constexpr uint64_t kChunk = (6 << 20) + 4096;  // more than one 4 MiB piece of a streamed route

IoOrder Now() { return IoOrder{.deadline = absl::Now()}; }

class RecordingListener final : public Mover::Listener {
 public:
  RecordingListener(absl::Mutex& mu, ChunkTable& chunks) : mu_(mu), chunks_(chunks) {}
  void MoveSettled(ChunkMeta& chunk, const Mover::Settlement& s) override {
    mu_.AssertHeld();
    settled.emplace_back(chunk.id, s.status);
    for (Path p : kAllPaths) {
      if (s.crossed[p] == 0) continue;
      EXPECT_EQ(s.crossed[p], chunk.size) << PathName(p);
      paths.push_back(p);
    }
    if (s.brought_in) {
      chunk.last_use = ++uses;
      chunks_.Reindex(chunk);
    }
  }

  std::vector<std::pair<ChunkId, absl::Status>> settled;
  std::vector<Path> paths;
  uint64_t uses = 0;

 private:
  absl::Mutex& mu_;
  ChunkTable& chunks_;
};

class MoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto rig = testing::ScratchTiers::Make({.segment_size = kSeg,
                                            .host_bytes = 8 * kSeg,
                                            .nvme_bytes = 256 << 20,
                                            .device_bytes = 8 * kSeg});
    ASSERT_TRUE(rig.ok()) << rig.status();
    rig_ = std::move(*rig);
    space_ = std::make_unique<Space>(chunks_, ledger_, rig_->tiers(), Clock::Real());
    mover_ = std::make_unique<Mover>(mu_, chunks_, *space_, rig_->tiers(), meter_, Clock::Real(),
                                     listener_);
  }
  void TearDown() override {
    mover_.reset();  // waits for the last callback
    space_.reset();
    rig_.reset();
  }

  // A chunk whose only copy is in host memory, filled with a pattern of `seed`.
  ChunkMeta& HostChunk(uint8_t seed) {
    absl::MutexLock lock(&mu_);
    ChunkMeta& c = chunks_.Insert(1000, "", /*persistent=*/false);
    c.owner = 7;
    c.size = kChunk;
    const Placement p = *space_->Reserve(TierKind::kHost, UserOwner(c.tenant), kChunk);
    c.placement[TierKind::kHost] = p;
    c.allocated.insert(TierKind::kHost);
    c.resident.insert(TierKind::kHost);
    chunks_.Reindex(c);
    auto* bytes = static_cast<uint8_t*>(rig_->host()->Address(p));
    for (uint64_t i = 0; i < kChunk; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + seed);
    return c;
  }

  bool Holds(const ChunkMeta& c, TierKind tier, uint8_t seed) {
    Tier* t = rig_->tiers().tier[tier];
    auto* bytes = static_cast<const uint8_t*>(t->Address(c.placement[tier]));
    for (uint64_t i = 0; i < kChunk; ++i) {
      if (bytes[i] != static_cast<uint8_t>(i * 7 + seed)) return false;
    }
    return true;
  }

  // Runs `start` (with the lock held) for a batch: the error it returned, else what the batch
  // completed with.
  template <typename F>
  absl::Status Move(F start) {
    absl::Notification done;
    absl::Status result;
    auto batch = std::make_shared<Batch>();
    batch->on_done = [&](const absl::Status& s) {
      result = s;
      done.Notify();
    };
    absl::Status started;
    {
      absl::MutexLock lock(&mu_);
      started = start(batch);
    }
    batch->Done(absl::OkStatus());  // the issuer's reference
    done.WaitForNotification();
    if (!started.ok()) {
      EXPECT_TRUE(result.ok()) << "a move that did not start failed its batch too: " << result;
      return started;
    }
    return result;
  }

  std::unique_ptr<testing::ScratchTiers> rig_;
  absl::Mutex mu_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  PathMeter meter_;
  RecordingListener listener_{mu_, chunks_};
  std::unique_ptr<Space> space_;
  std::unique_ptr<Mover> mover_;
};

TEST_F(MoverTest, AMoveToTheDeviceSettlesUnderTheLockAndIsReportedOnce) {
  ChunkMeta& c = HostChunk(3);
  ASSERT_TRUE(
      Move([&](auto batch) { return mover_->Fetch(c, TierKind::kDevice, batch, Now()); }).ok());
  mover_->WaitForIdle();
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(c.state, ChunkState::kReady);
  EXPECT_TRUE(c.resident.contains(TierKind::kDevice));
  EXPECT_TRUE(c.resident.contains(TierKind::kHost));  // copied, not moved away
  EXPECT_TRUE(Holds(c, TierKind::kDevice, 3));
  ASSERT_EQ(listener_.settled.size(), 1u);
  EXPECT_TRUE(listener_.settled[0].second.ok());
  EXPECT_EQ(listener_.paths, std::vector<Path>{Path::kHostToDevice});
  EXPECT_EQ(c.last_use, 1u);
  EXPECT_EQ(mover_->in_flight(), 0u);
}

TEST_F(MoverTest, AChunkOnlyOnNvmeStreamsToTheDeviceThroughItsHostSpace) {
  ChunkMeta& c = HostChunk(9);
  ASSERT_TRUE(Move([&](auto batch) {
                return mover_->WriteDown(c, TierKind::kHost, batch, /*keep_source=*/false, Now());
              }).ok());
  {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(c.resident.contains(TierKind::kNvme));
    EXPECT_FALSE(c.allocated.contains(TierKind::kHost));  // written down: the host copy went
  }
  ASSERT_TRUE(
      Move([&](auto batch) { return mover_->Fetch(c, TierKind::kDevice, batch, Now()); }).ok());
  mover_->WaitForIdle();
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(Holds(c, TierKind::kDevice, 9));
  EXPECT_TRUE(Holds(c, TierKind::kHost, 9));  // the staging copy counts too
  EXPECT_TRUE(c.resident.contains(TierKind::kHost));
  EXPECT_EQ(listener_.paths,
            (std::vector<Path>{Path::kHostToNvme, Path::kNvmeToHost, Path::kHostToDevice}));
  EXPECT_EQ(listener_.settled.size(), 2u);
}

TEST_F(MoverTest, ARetiredChunkStartsNoMoveAndTheStartSaysWhy) {
  ChunkMeta& c = HostChunk(1);
  {
    absl::MutexLock lock(&mu_);
    c.doomed = true;
  }
  absl::Status s =
      Move([&](auto batch) { return mover_->Fetch(c, TierKind::kDevice, batch, Now()); });
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(c.state, ChunkState::kReady);
  EXPECT_TRUE(listener_.settled.empty());
  EXPECT_EQ(mover_->in_flight(), 0u);
}

TEST_F(MoverTest, WaitForIdleReturnsOnlyOnceEveryMoveHasSettled) {
  std::vector<ChunkMeta*> chunks;
  for (uint8_t i = 0; i < 6; ++i) chunks.push_back(&HostChunk(i));
  auto batch = std::make_shared<Batch>();
  {
    absl::MutexLock lock(&mu_);
    for (ChunkMeta* c : chunks) {
      ASSERT_TRUE(mover_->Fetch(*c, TierKind::kDevice, batch, Now()).ok());
    }
    EXPECT_EQ(mover_->in_flight(), chunks.size());
  }
  batch->Done(absl::OkStatus());
  mover_->WaitForIdle();
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(listener_.settled.size(), chunks.size());
  EXPECT_EQ(mover_->in_flight(), 0u);
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_TRUE(Holds(*chunks[i], TierKind::kDevice, static_cast<uint8_t>(i))) << i;
  }
}

// RouteFor is the one place a move's route is chosen; from the copies a chunk has now:
TEST(MoverRouteTest, EachRouteComesFromTheCopiesThere) {
  using Route = Mover::Route;
  constexpr auto kUp = Mover::Direction::kUp, kDown = Mover::Direction::kDown;
  auto with = [](std::initializer_list<TierKind> tiers) {
    ChunkMeta c;
    for (TierKind t : tiers) c.resident.insert(t);
    return c;
  };
  const TierKind host = TierKind::kHost, nvme = TierKind::kNvme, device = TierKind::kDevice;
  // Only on NVMe: up to the device streams through the host's space.
  EXPECT_EQ(Mover::RouteFor(with({nvme}), device, kUp), Route::kNvmeToDevice);
  EXPECT_EQ(Mover::RouteFor(with({nvme}), host, kUp), Route::kNvmeToHost);
  // On the host.
  EXPECT_EQ(Mover::RouteFor(with({host}), device, kUp), Route::kHostToDevice);
  EXPECT_EQ(Mover::RouteFor(with({host}), nvme, kDown), Route::kHostToNvme);
  EXPECT_EQ(Mover::RouteFor(with({host}), host, kDown), std::nullopt);  // nothing above
  // Only on the device: down to the host, or to NVMe through the host.
  EXPECT_EQ(Mover::RouteFor(with({device}), host, kUp), Route::kDeviceToHost);
  EXPECT_EQ(Mover::RouteFor(with({device}), host, kDown), Route::kDeviceToHost);
  EXPECT_EQ(Mover::RouteFor(with({device}), nvme, kDown), Route::kDeviceToNvme);
  // On the device and NVMe: a fetch to the host reads NVMe and leaves the device copy (perhaps
  // acquired) alone; an eviction to the host copies the device's down.
  EXPECT_EQ(Mover::RouteFor(with({device, nvme}), host, kUp), Route::kNvmeToHost);
  EXPECT_EQ(Mover::RouteFor(with({device, nvme}), host, kDown), Route::kDeviceToHost);
  EXPECT_EQ(Mover::RouteFor(with({device, nvme}), nvme, kDown), std::nullopt);
  // On the host and the device: the host's copy goes down; the device already has one.
  EXPECT_EQ(Mover::RouteFor(with({host, device}), nvme, kDown), Route::kHostToNvme);
  EXPECT_EQ(Mover::RouteFor(with({host, device}), device, kUp), std::nullopt);
}

}  // namespace
}  // namespace tierd::daemon
