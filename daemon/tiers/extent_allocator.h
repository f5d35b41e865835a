// Best-fit allocation of aligned extents in a range [0, capacity), with coalescing of free space.
// Free extents are indexed by offset (to coalesce neighbours) and by (size, offset) (to find the
// smallest extent that fits), so Allocate and Free are O(log n) in the number of free extents.
// Best fit keeps large holes intact for large chunks, which is what 1-256 MiB chunk mixes need.
//
// Not thread-safe: the owner serializes calls.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace tierd::daemon {

class ExtentAllocator {
 public:
  // REQUIRES: alignment is a power of two; capacity is a multiple of alignment.
  ExtentAllocator(uint64_t capacity, uint64_t alignment);

  // Returns the offset of an extent of AlignUp(size) bytes, or nullopt when no free extent is large
  // enough. REQUIRES: size > 0.
  std::optional<uint64_t> Allocate(uint64_t size);

  // Like Allocate, with the extent's offset a multiple of `align` (a multiple of alignment()).
  std::optional<uint64_t> AllocateAligned(uint64_t size, uint64_t align);

  // Marks exactly [offset, offset+RoundUp(size)) as allocated, if all of it is free (recovery of
  // extents recorded on disk). Returns false, changing nothing, otherwise.
  bool AllocateAt(uint64_t offset, uint64_t size);

  // Returns an extent to the free space. REQUIRES: (offset, size) is exactly what Allocate gave.
  void Free(uint64_t offset, uint64_t size);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t used_bytes() const { return capacity_ - free_bytes_; }
  uint64_t largest_free() const;
  size_t free_extent_count() const { return by_offset_.size(); }
  uint64_t RoundUp(uint64_t size) const { return (size + alignment_ - 1) & ~(alignment_ - 1); }

 private:
  void Insert(uint64_t offset, uint64_t size);
  void Erase(std::map<uint64_t, uint64_t>::iterator it);

  const uint64_t capacity_;
  const uint64_t alignment_;
  uint64_t free_bytes_;
  std::map<uint64_t, uint64_t> by_offset_;           // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> by_size_;  // (size, offset)
};

}  // namespace tierd::daemon
