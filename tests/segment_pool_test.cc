#include "daemon/host_memory.h"

#include <sys/mman.h>

#include <cstring>

#include "gtest/gtest.h"

namespace tierd {
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
  EXPECT_TRUE(absl::IsInvalidArgument(pool->Reserve(1000, kSeg + 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(pool->Reserve(1000, 0).status()));
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
}  // namespace tierd
