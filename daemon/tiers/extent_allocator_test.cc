#include "daemon/tiers/extent_allocator.h"

#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kAlign = 4096;

TEST(ExtentAllocatorTest, AllocationsAreAlignedAndRoundedUp) {
  ExtentAllocator a(1 << 20, kAlign);
  auto x = a.Allocate(1);
  auto y = a.Allocate(5000);
  ASSERT_TRUE(x && y);
  EXPECT_EQ(*x % kAlign, 0u);
  EXPECT_EQ(*y % kAlign, 0u);
  EXPECT_EQ(a.used_bytes(), kAlign + 2 * kAlign);
}

TEST(ExtentAllocatorTest, FullRangeThenNothingFits) {
  ExtentAllocator a(16 * kAlign, kAlign);
  auto all = a.Allocate(16 * kAlign);
  ASSERT_TRUE(all.has_value());
  EXPECT_EQ(*all, 0u);
  EXPECT_FALSE(a.Allocate(1).has_value());
  a.Free(*all, 16 * kAlign);
  EXPECT_EQ(a.free_bytes(), 16 * kAlign);
  EXPECT_EQ(a.free_extent_count(), 1u);
}

TEST(ExtentAllocatorTest, LargerThanCapacityFails) {
  ExtentAllocator a(16 * kAlign, kAlign);
  EXPECT_FALSE(a.Allocate(17 * kAlign).has_value());
  EXPECT_EQ(a.free_bytes(), 16 * kAlign);
}

TEST(ExtentAllocatorTest, FreeCoalescesWithBothNeighbours) {
  ExtentAllocator a(3 * kAlign, kAlign);
  auto x = a.Allocate(kAlign), y = a.Allocate(kAlign), z = a.Allocate(kAlign);
  a.Free(*x, kAlign);
  a.Free(*z, kAlign);
  EXPECT_EQ(a.free_extent_count(), 2u);
  EXPECT_EQ(a.largest_free(), kAlign);
  a.Free(*y, kAlign);
  EXPECT_EQ(a.free_extent_count(), 1u);
  EXPECT_EQ(a.largest_free(), 3 * kAlign);
}

TEST(ExtentAllocatorTest, BestFitKeepsTheLargeHoleForLargeChunks) {
  ExtentAllocator a(100 * kAlign, kAlign);
  auto small_hole = a.Allocate(2 * kAlign);
  auto keep1 = a.Allocate(kAlign);
  auto big_hole = a.Allocate(50 * kAlign);
  auto keep2 = a.Allocate(kAlign);
  ASSERT_TRUE(small_hole && keep1 && big_hole && keep2);
  a.Free(*small_hole, 2 * kAlign);
  a.Free(*big_hole, 50 * kAlign);
  // A 2-page chunk goes into the 2-page hole, leaving the 50-page hole whole.
  auto fit = a.Allocate(2 * kAlign);
  EXPECT_EQ(*fit, *small_hole);
  EXPECT_TRUE(a.Allocate(50 * kAlign).has_value());
}

// Random allocate/free sequences against a model that tracks every page.
TEST(ExtentAllocatorTest, RandomSequencesMatchAPageModel) {
  constexpr uint64_t kPages = 4096;
  ExtentAllocator a(kPages * kAlign, kAlign);
  std::vector<bool> used(kPages, false);
  std::map<uint64_t, uint64_t> live;  // offset -> size
  std::mt19937_64 rng(42);
  for (int step = 0; step < 50000; ++step) {
    const bool alloc = live.empty() || rng() % 100 < 55;
    if (alloc) {
      // Sizes from one byte to 64 pages, skewed small like a real chunk mix.
      uint64_t size = 1 + rng() % ((rng() % 4 == 0 ? 64 : 4) * kAlign);
      auto off = a.Allocate(size);
      const uint64_t pages = (size + kAlign - 1) / kAlign;
      if (!off) {
        // Must really not fit: no run of `pages` free pages in the model.
        uint64_t run = 0, best = 0;
        for (bool u : used) {
          run = u ? 0 : run + 1;
          best = std::max(best, run);
        }
        ASSERT_LT(best, pages) << "allocator refused " << size << " bytes that fit";
        continue;
      }
      ASSERT_EQ(*off % kAlign, 0u);
      ASSERT_LE(*off + pages * kAlign, kPages * kAlign);
      for (uint64_t p = *off / kAlign; p < *off / kAlign + pages; ++p) {
        ASSERT_FALSE(used[p]) << "page " << p << " handed out twice";
        used[p] = true;
      }
      live[*off] = size;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      const uint64_t pages = (it->second + kAlign - 1) / kAlign;
      for (uint64_t p = it->first / kAlign; p < it->first / kAlign + pages; ++p) used[p] = false;
      a.Free(it->first, it->second);
      live.erase(it);
    }
    uint64_t model_used = 0;
    for (bool u : used) model_used += u;
    ASSERT_EQ(a.used_bytes(), model_used * kAlign);
  }
  for (auto [off, size] : live) a.Free(off, size);
  EXPECT_EQ(a.free_extent_count(), 1u);  // everything coalesced back
  EXPECT_EQ(a.free_bytes(), kPages * kAlign);
}

// 1-256 MiB chunk mix at steady state: fragmentation stays low (a large chunk still fits while
// the pool is three quarters full of mixed chunks).
TEST(ExtentAllocatorTest, ChunkMixFragmentationStaysLow) {
  constexpr uint64_t kMiB = 1 << 20;
  ExtentAllocator a(4096 * kMiB, kAlign);
  std::mt19937_64 rng(7);
  const uint64_t sizes[] = {1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB, 256 * kMiB};
  std::vector<std::pair<uint64_t, uint64_t>> live;
  for (int step = 0; step < 20000; ++step) {
    if (a.used_bytes() < 3 * a.capacity() / 4) {
      uint64_t size = sizes[rng() % 5];
      if (auto off = a.Allocate(size)) live.push_back({*off, size});
    } else {
      size_t i = rng() % live.size();
      a.Free(live[i].first, live[i].second);
      live[i] = live.back();
      live.pop_back();
    }
  }
  // With a quarter of the space free, the largest hole holds a 256 MiB chunk.
  EXPECT_GE(a.largest_free(), 256 * kMiB)
      << "free " << a.free_bytes() << " in " << a.free_extent_count() << " extents";
}

}  // namespace
}  // namespace tierd::daemon

namespace tierd::daemon {
namespace {

TEST(ExtentAllocatorTest, AlignedAllocationsStartOnTheBoundaryAndWasteNothing) {
  ExtentAllocator a(64 * kAlign, kAlign);
  auto small = a.Allocate(kAlign);  // pushes the next free byte off the 16-page boundary
  auto big = a.AllocateAligned(16 * kAlign, 16 * kAlign);
  ASSERT_TRUE(small && big);
  EXPECT_EQ(*big % (16 * kAlign), 0u);
  EXPECT_EQ(a.used_bytes(), 17 * kAlign);  // the padding went back to the free space
}

TEST(ExtentAllocatorTest, AllocateAtClaimsExactlyTheRecordedExtent) {
  ExtentAllocator a(64 * kAlign, kAlign);
  EXPECT_TRUE(a.AllocateAt(8 * kAlign, 4 * kAlign));
  EXPECT_FALSE(a.AllocateAt(10 * kAlign, kAlign));      // overlaps
  EXPECT_FALSE(a.AllocateAt(63 * kAlign, 2 * kAlign));  // past the end
  EXPECT_EQ(a.used_bytes(), 4 * kAlign);
  a.Free(8 * kAlign, 4 * kAlign);
  EXPECT_EQ(a.free_extent_count(), 1u);
}

}  // namespace
}  // namespace tierd::daemon
