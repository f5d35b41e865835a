// The device tier on the emulated backend, with the host tier and a real NVMe tier: three-tier
// round trips with data checks, NVMe -> host -> GPU pipelining, dirty write-back, a full device.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include "daemon/chunks/chunk_service.h"
#include "gtest/gtest.h"
#include "testing/scratch_tiers.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 16 << 20;

// Records when copies to the device are issued, then forwards to the emulated device.
class RecordingDevice final : public Device {
 public:
  explicit RecordingDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  const DeviceDescription& description() const override { return inner_->description(); }
  std::unique_ptr<SegmentBacking> MakeBacking() override { return inner_->MakeBacking(); }
  absl::Status RegisterHost(void* base, size_t size) override {
    return inner_->RegisterHost(base, size);
  }
  absl::Status UnregisterHost(void* base) override { return inner_->UnregisterHost(base); }
  void CopyToDevice(void* dst, const void* src, uint64_t bytes, Callback done) override {
    if (on_copy_to_device) on_copy_to_device();
    ++to_device;
    inner_->CopyToDevice(dst, src, bytes, std::move(done));
  }
  void CopyToHost(void* dst, const void* src, uint64_t bytes, Callback done) override {
    ++to_host;
    inner_->CopyToHost(dst, src, bytes, std::move(done));
  }
  void Drain() override { inner_->Drain(); }

  std::atomic<int> to_device{0};
  std::atomic<int> to_host{0};
  std::function<void()> on_copy_to_device;

 private:
  std::unique_ptr<Device> inner_;
};

class ChunkServiceDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::ScratchTierOptions o{.segment_size = kSeg,
                                  .host_bytes = 4 * kSeg,
                                  .nvme_bytes = 128 << 20,
                                  .device_bytes = 2 * kSeg,
                                  .device_latency = absl::Microseconds(20)};
    o.nvme.stripe_unit = 1 << 20;
    o.nvme.io_size = 128 << 10;
    o.nvme.queue_depth = 8;
    o.nvme.wrap_backend = [this](std::unique_ptr<IoBackend> inner) {
      auto f = std::make_unique<FaultInjectingBackend>(std::move(inner));
      faults_ = f.get();
      return f;
    };
    o.wrap_device = [this](std::unique_ptr<Device> inner) {
      auto d = std::make_unique<RecordingDevice>(std::move(inner));
      device_ = d.get();
      return d;
    };
    auto rig = testing::ScratchTiers::Make(o);
    ASSERT_TRUE(rig.ok()) << rig.status();
    rig_ = std::move(*rig);
    service_ = std::make_unique<ChunkService>(rig_->tiers());
    session_ = *sessions_.Open({1000, 1000, 1}, "gpu-rank");
    void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   session_->completions->fd(), 0);
    page_ = static_cast<CompletionPage*>(p);
  }
  void TearDown() override {
    if (rig_ == nullptr) return;  // SetUp failed
    // Moves in flight settle before the service they call back into goes.
    rig_->Drain();
    service_.reset();
    rig_.reset();
    munmap(page_, kCompletionPageBytes);
  }

  absl::Status Wait(absl::StatusOr<SlotToken> token) {
    if (!token.ok()) return token.status();
    return WaitCompletion(*page_, *token, absl::Seconds(30));
  }
  std::vector<ChunkId> Alloc(std::vector<uint64_t> sizes, TierKind home = TierKind::kHost) {
    std::vector<ChunkRequest> r;
    for (uint64_t size : sizes) r.push_back({.size = size, .home = home});
    return *service_->Allocate(*session_, r);
  }
  // Fills (acquire for write) or checks (acquire for read) the chunks' copies in `tier`. The
  // emulated device's memory is host memory, so the test can look at it directly.
  void Fill(const std::vector<ChunkId>& ids, TierKind tier, uint8_t value) {
    auto a = service_->Acquire(*session_, ids, tier, Access::kWrite);
    ASSERT_TRUE(a.ok()) << a.status();
    for (const Placement& p : a->locations) {
      std::memset(service_->tier(tier)->Address(p), value, p.size);
    }
    ASSERT_TRUE(service_->Release(*session_, ids).ok());
  }
  bool Holds(const std::vector<ChunkId>& ids, TierKind tier, uint8_t value, uint64_t size) {
    auto a = service_->Acquire(*session_, ids, tier, Access::kRead);
    if (!a.ok()) {
      ADD_FAILURE() << a.status();
      return false;
    }
    if (absl::Status ready = Wait(a->ready); !ready.ok()) {
      ADD_FAILURE() << ready;
      return false;
    }
    bool ok = true;
    for (const Placement& p : a->locations) {
      const auto* b = static_cast<const unsigned char*>(service_->tier(tier)->Address(p));
      for (uint64_t i = 0; i < size && ok; ++i) ok = b[i] == value;
    }
    EXPECT_TRUE(service_->Release(*session_, ids).ok());
    return ok;
  }

  std::unique_ptr<testing::ScratchTiers> rig_;
  FaultInjectingBackend* faults_ = nullptr;
  RecordingDevice* device_ = nullptr;  // the rig's device
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> session_;
  CompletionPage* page_ = nullptr;
};

TEST_F(ChunkServiceDeviceTest, HostToDeviceAndBackCarriesTheGpusWrites) {
  auto ids = Alloc({1 << 20, 3 << 20});
  Fill(ids, TierKind::kHost, 0x11);
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  EXPECT_TRUE(Holds(ids, TierKind::kDevice, 0x11, 1 << 20));
  Fill(ids, TierKind::kDevice, 0x22);  // the GPU writes: the host copy is stale now
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_TRUE(stat[0].dirty.contains(TierKind::kDevice));
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kHost)).ok());
  EXPECT_EQ(rig_->device_pool()->Usage().used_bytes,
            0u);  // device copies dropped once written back
  EXPECT_TRUE(Holds(ids, TierKind::kHost, 0x22, 3 << 20));
  EXPECT_GE(device_->to_host.load(), 2);
}

TEST_F(ChunkServiceDeviceTest, DirtyDeviceCopyIsWrittenBackThroughTheHostToNvme) {
  auto ids = Alloc({2 << 20}, TierKind::kNvme);
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  Fill(ids, TierKind::kDevice, 0x5A);
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kNvme));
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kDevice));
  EXPECT_TRUE(stat[0].dirty.empty());
  EXPECT_EQ(rig_->host()->Usage().used_bytes, 0u);
  EXPECT_EQ(rig_->device_pool()->Usage().used_bytes, 0u);
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  EXPECT_TRUE(Holds(ids, TierKind::kHost, 0x5A, 2 << 20));
}

TEST_F(ChunkServiceDeviceTest, NvmeToDevicePrefetchPipelinesThroughHostMemory) {
  constexpr uint64_t kSize = 12 << 20;  // three 4 MiB pieces
  auto ids = Alloc({kSize});
  Fill(ids, TierKind::kHost, 0x77);
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  // A slow drive: each read completes 10 ms after it is issued, 8 in flight.
  faults_->SetDelay(absl::Milliseconds(10));
  const uint64_t reads_before = faults_->seen(IoKind::kRead);
  uint64_t reads_at_first_copy = 0;
  device_->on_copy_to_device = [&] {
    if (reads_at_first_copy == 0) reads_at_first_copy = faults_->seen(IoKind::kRead) - reads_before;
  };
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  faults_->SetDelay(absl::ZeroDuration());
  device_->on_copy_to_device = nullptr;
  // 96 reads of 128 KiB; the first piece went to the GPU while later reads had not been issued.
  EXPECT_EQ(faults_->seen(IoKind::kRead) - reads_before, kSize / (128 << 10));
  EXPECT_GT(reads_at_first_copy, 0u);
  EXPECT_LT(reads_at_first_copy, kSize / (128 << 10));
  EXPECT_EQ(device_->to_device.load(), 3);
  EXPECT_TRUE(Holds(ids, TierKind::kDevice, 0x77, kSize));
  EXPECT_TRUE(service_->Stat(*session_, ids)->at(0).resident.contains(TierKind::kHost));
}

TEST_F(ChunkServiceDeviceTest, DamagedNvmeDataNeverReachesTheDevice) {
  auto ids = Alloc({1 << 20});
  Fill(ids, TierKind::kHost, 0x33);
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  // Corrupt the region's whole data area: whatever the chunk's offset, its bytes change.
  {
    int fd = open((rig_->dir() + "/r0").c_str(), O_RDWR);
    std::vector<char> junk(1 << 20, 0x44);
    for (off_t off = 2 << 20; off < (128 << 20); off += junk.size()) {
      ASSERT_EQ(pwrite(fd, junk.data(), junk.size(), off), static_cast<ssize_t>(junk.size()));
    }
    close(fd);
  }
  absl::Status s = Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kDevice));
  EXPECT_EQ(rig_->device_pool()->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceDeviceTest, FullDeviceDropsCleanCopiesAndWritesDirtyOnesDownFirst) {
  auto clean = Alloc({kSeg, kSeg});
  Fill(clean, TierKind::kHost, 1);
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, clean, TierKind::kDevice, 0)).ok());
  auto more = Alloc({kSeg});
  Fill(more, TierKind::kHost, 2);
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, more, TierKind::kDevice, 0)).ok());
  EXPECT_FALSE(service_->Stat(*session_, clean)->at(0).resident.contains(TierKind::kDevice));
  // Every device copy dirty: the least recently used is copied to the host before its room is
  // reused, and nothing the GPU wrote is lost.
  std::vector<ChunkId> on_device = {clean[1], more[0]};
  Fill(on_device, TierKind::kDevice, 3);
  const int to_host = device_->to_host.load();
  std::vector<ChunkId> first = {clean[0]};
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, first, TierKind::kDevice, 0)).ok());
  EXPECT_EQ(device_->to_host.load(), to_host + 1);
  auto stat = *service_->Stat(*session_, on_device);
  const size_t evicted = stat[0].resident.contains(TierKind::kDevice) ? 1 : 0;
  EXPECT_FALSE(stat[evicted].resident.contains(TierKind::kDevice));
  EXPECT_TRUE(stat[evicted].resident.contains(TierKind::kHost));
  EXPECT_TRUE(Holds(first, TierKind::kDevice, 1, kSeg));
  // With the device's copies acquired, none may go: the next one has no room.
  std::vector<ChunkId> held = {first[0], on_device[1 - evicted]};
  ASSERT_TRUE(service_->Acquire(*session_, held, TierKind::kDevice, Access::kWrite).ok());
  std::vector<ChunkId> other = {on_device[evicted]};
  absl::Status s = Wait(service_->Prefetch(*session_, other, TierKind::kDevice, 0));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("device tier full"), std::string::npos) << s;
  ASSERT_TRUE(service_->Release(*session_, held).ok());
  EXPECT_TRUE(Holds(on_device, TierKind::kHost, 3, kSeg));
}

// A chunk on its way into the host tier, acquired on the device: the Acquire waits for that move
// and then follows the chunk up, rather than failing.
TEST_F(ChunkServiceDeviceTest, AcquireOfAChunkMovingElsewhereWaitsAndThenBringsItIn) {
  auto ids = Alloc({4 << 20});
  Fill(ids, TierKind::kHost, 0x3C);
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(10));
  auto up = service_->Prefetch(*session_, ids, TierKind::kHost, 0);
  ASSERT_TRUE(up.ok());
  ASSERT_EQ(service_->Stat(*session_, ids)->at(0).moving_to, TierKind::kHost);
  auto a = service_->Acquire(*session_, ids, TierKind::kDevice, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(Wait(a->ready).ok());
  EXPECT_TRUE(Wait(*up).ok());
  faults_->SetDelay(absl::ZeroDuration());
  const auto* b = static_cast<const unsigned char*>(
      service_->tier(TierKind::kDevice)->Address(a->locations[0]));
  EXPECT_EQ(b[0], 0x3C);
  EXPECT_EQ(b[(4 << 20) - 1], 0x3C);
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
}

// Requests that waited for one move are served in turn when it settles; one of them may start the
// next move (here: host -> device), and an acquisition served after it used to apply to a chunk
// already moving again (an assertion in the daemon, found by the soak). It now waits for that
// move too.
TEST_F(ChunkServiceDeviceTest, WaitersServedAfterAnotherWaitersMoveStartedWaitForItToo) {
  auto ids = Alloc({4 << 20});
  Fill(ids, TierKind::kHost, 0x5A);
  ASSERT_TRUE(Wait(service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(20));
  auto up = service_->Prefetch(*session_, ids, TierKind::kHost, 0);
  ASSERT_TRUE(up.ok());
  auto to_device = service_->Prefetch(*session_, ids, TierKind::kDevice, 0);
  ASSERT_TRUE(to_device.ok()) << to_device.status();
  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kWrite);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(Wait(*up).ok());
  EXPECT_TRUE(Wait(*to_device).ok());
  ASSERT_TRUE(Wait(a->ready).ok());
  faults_->SetDelay(absl::ZeroDuration());
  auto* b = static_cast<unsigned char*>(service_->tier(TierKind::kHost)->Address(a->locations[0]));
  EXPECT_EQ(b[0], 0x5A);
  std::memset(b, 0x6B, 4 << 20);
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  EXPECT_TRUE(Holds(ids, TierKind::kDevice, 0x6B, 4 << 20));
}

// A copy made while the client writes the chunk would miss the rest of the write and then pass for
// a valid copy: while a write acquisition is in effect, no copy of the chunk is made.
TEST_F(ChunkServiceDeviceTest, NoCopyIsMadeOfAChunkWhileItIsAcquiredForWrite) {
  auto ids = Alloc({1 << 20});
  Fill(ids, TierKind::kHost, 0x11);
  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kWrite);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Wait(a->ready).ok());
  auto* b = static_cast<unsigned char*>(service_->tier(TierKind::kHost)->Address(a->locations[0]));
  std::memset(b, 0x22, 1 << 19);  // half written so far
  absl::Status copy = Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0));
  EXPECT_TRUE(absl::IsFailedPrecondition(copy)) << copy;
  EXPECT_NE(copy.message().find("acquired for write"), std::string::npos) << copy;
  // A second acquisition for read, released, leaves the write in force.
  auto r = service_->Acquire(*session_, ids, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(Wait(r->ready).ok());
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  EXPECT_TRUE(
      absl::IsFailedPrecondition(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0))));
  std::memset(b + (1 << 19), 0x22, 1 << 19);
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  EXPECT_TRUE(Holds(ids, TierKind::kDevice, 0x22, 1 << 20));
}

// Gradients written on the GPU from scratch: an overwrite on the device needs no host room to
// stage through and copies nothing to the device, where a write must bring the old contents in.
TEST_F(ChunkServiceDeviceTest, AnOverwriteOnTheDeviceStagesNothingThroughTheHost) {
  auto grads = Alloc({kSeg}, TierKind::kNvme);
  auto first = service_->Acquire(*session_, grads, TierKind::kHost, Access::kOverwrite);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(Wait(first->ready).ok());
  std::memset(service_->tier(TierKind::kHost)->Address(first->locations[0]), 1, kSeg);
  ASSERT_TRUE(service_->Release(*session_, grads).ok());
  ASSERT_TRUE(Wait(service_->Evict(*session_, grads, TierKind::kNvme)).ok());
  auto filler = Alloc({kSeg, kSeg, kSeg, kSeg});  // the host tier, full and pinned
  ASSERT_TRUE(service_->Acquire(*session_, filler, TierKind::kHost, Access::kRead).ok());
  auto write = service_->Acquire(*session_, grads, TierKind::kDevice, Access::kWrite);
  EXPECT_TRUE(absl::IsResourceExhausted(write.status())) << write.status();

  const int to_device = device_->to_device.load();
  auto a = service_->Acquire(*session_, grads, TierKind::kDevice, Access::kOverwrite);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Wait(a->ready).ok());
  EXPECT_EQ(device_->to_device.load(), to_device);
  std::memset(service_->tier(TierKind::kDevice)->Address(a->locations[0]), 7, kSeg);
  ASSERT_TRUE(service_->Release(*session_, grads).ok());
  ASSERT_TRUE(service_->Release(*session_, filler).ok());
  EXPECT_TRUE(Holds(grads, TierKind::kHost, 7, kSeg));
}

TEST_F(ChunkServiceDeviceTest, SessionEndReclaimsAcquiredDeviceChunks) {
  auto ids = Alloc({1 << 20, 1 << 20});
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  ASSERT_TRUE(service_->Acquire(*session_, ids, TierKind::kDevice, Access::kWrite).ok());
  EXPECT_GT(rig_->device_pool()->Usage().used_bytes, 0u);
  EXPECT_EQ(service_->CloseSession(*session_), 2u);
  EXPECT_EQ(rig_->device_pool()->Usage().used_bytes, 0u);
  EXPECT_EQ(rig_->host()->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceDeviceTest, EvictIntoTheDeviceIsInvalidAndPinnedDeviceCopiesStay) {
  auto ids = Alloc({1 << 20});
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Evict(*session_, ids, TierKind::kDevice).status()));
  ASSERT_TRUE(Wait(service_->Prefetch(*session_, ids, TierKind::kDevice, 0)).ok());
  ASSERT_TRUE(service_->Acquire(*session_, ids, TierKind::kDevice, Access::kWrite).ok());
  EXPECT_TRUE(
      absl::IsFailedPrecondition(service_->Evict(*session_, ids, TierKind::kHost).status()));
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
}

}  // namespace
}  // namespace tierd::daemon
