#include "daemon/tiers/host/host_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "daemon/tiers/device/device.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;

std::unique_ptr<SegmentPool> MakePool(uint64_t segments) {
  HostPoolOptions o;
  o.capacity = segments * kSeg;
  o.segment_size = kSeg;
  o.huge_pages = HugePagePolicy::kNever;
  o.lock_memory = false;  // unit tests run without memlock rights too
  auto pool = CreateHostPool(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

TEST(SegmentPoolTest, RejectsCapacityNotAMultipleOfTheSegmentSize) {
  HostPoolOptions o{.capacity = 5 << 20, .segment_size = 4 << 20, .lock_memory = false};
  absl::Status s = CreateHostPool(o).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("host.capacity"), std::string::npos);
}

TEST(SegmentPoolTest, RejectsSegmentsThatAreNotWholeHugePages) {
  HostPoolOptions o{.capacity = 3 << 20, .segment_size = 3 << 20, .lock_memory = false};
  EXPECT_TRUE(absl::IsInvalidArgument(CreateHostPool(o).status()));
}

TEST(SegmentPoolTest, RequiredHugePagesFailWhenNoneAreReservedOrSucceed) {
  HostPoolOptions o{.capacity = kSeg,
                    .segment_size = kSeg,
                    .huge_pages = HugePagePolicy::kRequire,
                    .lock_memory = false};
  auto pool = CreateHostPool(o);
  // Either the machine has huge pages reserved (and the pool says so) or creation fails loudly;
  // never a silent fallback.
  if (pool.ok()) {
    EXPECT_TRUE(static_cast<MemfdBacking*>((*pool)->backing())->huge_pages());
  } else {
    EXPECT_NE(pool.status().message().find("huge pages"), std::string::npos) << pool.status();
  }
}

TEST(SegmentPoolTest, PinnableCheckNamesTheLimitToRaise) {
  absl::Status s = CheckPinnable(1ull << 60);  // more than any machine has
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(s.message().find("RLIMIT_MEMLOCK") != std::string::npos ||
              s.message().find("MemAvailable") != std::string::npos)
      << s;
}

TEST(SegmentPoolTest, TenantGetsFdsOnlyForItsOwnSegments) {
  auto pool = MakePool(2);
  auto a = pool->Reserve(1000, 4096);
  auto b = pool->Reserve(2000, 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->segment, b->segment);  // tenants never share a segment
  EXPECT_TRUE(pool->SegmentFd(a->segment, 1000, nullptr).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(pool->SegmentFd(a->segment, 2000, nullptr).status()));
  EXPECT_TRUE(absl::IsNotFound(pool->SegmentFd(99, 1000, nullptr).status()));
  ASSERT_EQ(pool->SegmentsOf(1000).size(), 1u);
  EXPECT_EQ(pool->SegmentsOf(1000)[0].segment, a->segment);
}

TEST(SegmentPoolTest, SegmentPassesToAnotherTenantOnlyAsFreshZeroedMemory) {
  auto pool = MakePool(1);
  auto a = pool->Reserve(1000, kSeg);
  ASSERT_TRUE(a.ok());
  SegmentInfo info_a;
  auto fd_a = pool->SegmentFd(a->segment, 1000, &info_a);
  ASSERT_TRUE(fd_a.ok());
  // Tenant 1000 maps the segment and fills it with secrets.
  void* view = mmap(nullptr, kSeg, PROT_READ | PROT_WRITE, MAP_SHARED, fd_a->get(), 0);
  ASSERT_NE(view, MAP_FAILED);
  std::memset(view, 0xAB, kSeg);
  pool->Unreserve(*a);

  auto b = pool->Reserve(2000, kSeg);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->segment, a->segment);
  EXPECT_GT(b->generation, a->generation);  // a new memfd, not the old pages
  const auto* bytes = static_cast<const unsigned char*>(pool->Address(*b));
  for (uint64_t i = 0; i < kSeg; i += 4096) ASSERT_EQ(bytes[i], 0) << "offset " << i;
  // Tenant 2000 writes; tenant 1000's old mapping does not see it.
  std::memset(pool->Address(*b), 0x5C, 4096);
  EXPECT_EQ(static_cast<unsigned char*>(view)[0], 0xAB);
  munmap(view, kSeg);
}

// Memory from the heap that counts how many segments' worth is live at once.
class CountingBacking : public SegmentBacking {
 public:
  explicit CountingBacking(int* live, int* most) : live_(live), most_(most) {}
  absl::StatusOr<SegmentMemory> Create(uint32_t, uint64_t size) override {
    SegmentMemory m;
    m.base = new char[size]();
    *most_ = std::max(*most_, ++*live_);
    return m;
  }
  void Destroy(SegmentMemory& memory, uint64_t) override {
    delete[] static_cast<char*>(memory.base);
    memory.base = nullptr;
    --*live_;
  }
  std::string Describe() const override { return "counting"; }

 private:
  int* live_;
  int* most_;
};

// A segment that passes to another tenant gives its old memory back before new memory is made:
// the pool never holds more than its capacity, not even for a moment (it made a segment's worth
// more, populated and locked, while the old was still mapped).
TEST(SegmentPoolTest, ARecycledSegmentsOldMemoryGoesBeforeTheNewIsMade) {
  int live = 0;
  int most = 0;
  auto pool = SegmentPool::Create(TierKind::kHost, "host", 2 * kSeg, kSeg,
                                  std::make_unique<CountingBacking>(&live, &most));
  ASSERT_TRUE(pool.ok()) << pool.status();
  for (uint32_t tenant : {1000u, 2000u, 1000u}) {
    auto a = (*pool)->Reserve(tenant, kSeg);
    auto b = (*pool)->Reserve(tenant, kSeg);
    ASSERT_TRUE(a.ok() && b.ok());
    (*pool)->Unreserve(*a);
    (*pool)->Unreserve(*b);
  }
  EXPECT_EQ(live, 2);
  EXPECT_EQ(most, 2) << "more memory than the capacity was live at once";
}

TEST(SegmentPoolTest, SameTenantReusesItsSegmentWithoutRecycling) {
  auto pool = MakePool(1);
  auto a = pool->Reserve(1000, 4096);
  pool->Unreserve(*a);
  auto again = pool->Reserve(1000, 4096);
  EXPECT_EQ(again->generation, a->generation);
}

TEST(SegmentPoolTest, FullPoolSaysHowFullAndWhatToDo) {
  auto pool = MakePool(2);
  ASSERT_TRUE(pool->Reserve(1000, kSeg).ok());
  ASSERT_TRUE(pool->Reserve(1000, kSeg).ok());
  absl::Status s = pool->Reserve(1000, 4096).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("8 MiB of 8 MiB in use"), std::string::npos) << s;
  EXPECT_NE(s.message().find("host.capacity"), std::string::npos) << s;
  EXPECT_EQ(pool->Usage().used_bytes, 2 * kSeg);
}

TEST(SegmentPoolTest, ChunkLargerThanASegmentIsInvalid) {
  auto pool = MakePool(2);
  absl::Status s = pool->Reserve(1000, kSeg + 1).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("host tier cannot hold"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(pool->Reserve(1000, 0).status()));
  // A device pool names its own tier and setting, not the host's.
  int live = 0, most = 0;
  auto device = SegmentPool::Create(TierKind::kDevice, "device", 2 * kSeg, kSeg,
                                    std::make_unique<CountingBacking>(&live, &most));
  ASSERT_TRUE(device.ok()) << device.status();
  s = (*device)->Reserve(1000, kSeg + 1).status();
  EXPECT_NE(s.message().find("device tier cannot hold"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(device.segment_size)"), std::string::npos) << s;
}

TEST(SegmentPoolTest, UsageTracksReservations) {
  auto pool = MakePool(2);
  auto a = pool->Reserve(1000, 5000);  // rounds up to 8 KiB
  TierUsage u = pool->Usage();
  EXPECT_EQ(u.capacity_bytes, 2 * kSeg);
  EXPECT_EQ(u.used_bytes, 8192u);
  EXPECT_EQ(u.largest_free_bytes, kSeg);  // the untouched segment
  pool->Unreserve(*a);
  EXPECT_EQ(pool->Usage().used_bytes, 0u);
}

}  // namespace
}  // namespace tierd::daemon

namespace tierd::daemon {
namespace {

bool Mapped(const void* base, size_t size) {
  return msync(const_cast<void*>(base), size, MS_ASYNC) == 0;
}

// A device that only checks host registrations the way the CUDA driver needs them: each range
// registered once, unregistered exactly once and while still mapped.
class PairingDevice final : public Device {
 public:
  const DeviceDescription& description() const override { return description_; }
  std::unique_ptr<SegmentBacking> MakeBacking() override { return nullptr; }
  absl::Status RegisterHost(void* base, size_t size) override {
    if (refuse) return absl::PermissionDeniedError("sandbox says no");
    EXPECT_TRUE(Mapped(base, size)) << "registering unmapped memory " << base;
    for (const auto& [b, n] : registered) {
      EXPECT_FALSE(static_cast<char*>(base) < static_cast<char*>(b) + n &&
                   static_cast<char*>(b) < static_cast<char*>(base) + size)
          << base << " overlaps a registration at " << b;
    }
    registered[base] = size;
    ++registrations;
    return absl::OkStatus();
  }
  absl::Status UnregisterHost(void* base) override {
    auto it = registered.find(base);
    EXPECT_NE(it, registered.end()) << "unregistering " << base << ", never registered";
    if (it == registered.end()) return absl::NotFoundError("not registered");
    EXPECT_TRUE(Mapped(base, it->second)) << base << " was unmapped before it was unregistered";
    registered.erase(it);
    return absl::OkStatus();
  }
  void CopyToDevice(void*, const void*, uint64_t, Callback done) override {
    done(absl::OkStatus());
  }
  void CopyToHost(void*, const void*, uint64_t, Callback done) override { done(absl::OkStatus()); }
  void Drain() override {}

  // Every registration is of memory that is still mapped.
  bool AllMapped() const {
    for (const auto& [b, n] : registered) {
      if (!Mapped(b, n)) return false;
    }
    return true;
  }

  std::map<void*, size_t> registered;
  int registrations = 0;
  bool refuse = false;

 private:
  DeviceDescription description_;
};

TEST(HostRegistrationTest, ASegmentThatChangesTenantIsUnregisteredBeforeItIsUnmapped) {
  auto pool = MakePool(2);
  PairingDevice device;
  {
    HostRegistration registration(pool.get(), &device);
    EXPECT_EQ(device.registered.size(), 2u);
    // Each tenant in turn takes both segments: every turn recycles both.
    for (uint32_t tenant : {1000u, 2000u, 1000u, 3000u}) {
      auto a = pool->Reserve(tenant, kSeg);
      auto b = pool->Reserve(tenant, kSeg);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(device.registered.size(), 2u) << "tenant " << tenant;
      EXPECT_TRUE(device.registered.count(pool->Address(*a)) == 1 &&
                  device.registered.count(pool->Address(*b)) == 1)
          << "the segments' current memory is registered";
      EXPECT_TRUE(device.AllMapped());
      pool->Unreserve(*a);
      pool->Unreserve(*b);
    }
    EXPECT_EQ(device.registrations, 2 + 3 * 2);  // the first tenant needs no recycling
  }
  EXPECT_TRUE(device.registered.empty()) << "still registered after the registration ended";
}

TEST(HostRegistrationTest, SegmentsTheGpuRefusesAreReportedAsAFallback) {
  auto pool = MakePool(2);
  PairingDevice device;
  device.refuse = true;
  Fallbacks fallbacks;
  {
    HostRegistration registration(pool.get(), &device, &fallbacks);
    auto list = fallbacks.List();
    ASSERT_EQ(list.size(), 1u);
    EXPECT_EQ(list[0].first, "host_segments_unregistered");
    EXPECT_NE(list[0].second.find("2 host segment(s)"), std::string::npos) << list[0].second;
    EXPECT_NE(list[0].second.find("sandbox says no"), std::string::npos) << list[0].second;
    // A refused segment that changes tenant is not counted twice, nor unregistered.
    auto a = pool->Reserve(1000, kSeg);
    ASSERT_TRUE(a.ok());
    pool->Unreserve(*a);
    auto b = pool->Reserve(2000, kSeg);
    ASSERT_TRUE(b.ok());
    EXPECT_NE(fallbacks.List()[0].second.find("2 host segment(s)"), std::string::npos);
    pool->Unreserve(*b);
  }
  EXPECT_TRUE(device.registered.empty());
}

TEST(HostRegistrationTest, TheEmulatedDeviceRefusesWhatTheDriverRefuses) {
  auto device = MakeEmulatedDevice({});
  std::vector<char> memory(1 << 16);
  ASSERT_TRUE(device->RegisterHost(memory.data(), 1 << 15).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(device->RegisterHost(memory.data() + 4096, 4096)));
  EXPECT_TRUE(absl::IsNotFound(device->UnregisterHost(memory.data() + 4096)));
  EXPECT_TRUE(device->UnregisterHost(memory.data()).ok());
  EXPECT_TRUE(absl::IsNotFound(device->UnregisterHost(memory.data())));
  EXPECT_TRUE(device->RegisterHost(memory.data() + 4096, 4096).ok());
  EXPECT_TRUE(device->UnregisterHost(memory.data() + 4096).ok());
}

}  // namespace
}  // namespace tierd::daemon
