#include "daemon/tiers/extent_allocator.h"

#include <cassert>

namespace tierd::daemon {

ExtentAllocator::ExtentAllocator(uint64_t capacity, uint64_t alignment)
    : capacity_(capacity), alignment_(alignment), free_bytes_(0) {
  assert(alignment != 0 && (alignment & (alignment - 1)) == 0);
  assert(capacity % alignment == 0);
  if (capacity > 0) Insert(0, capacity);
  free_bytes_ = capacity;
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t size) {
  assert(size > 0);
  if (size > capacity_) return std::nullopt;
  const uint64_t need = RoundUp(size);
  auto fit = by_size_.lower_bound({need, 0});
  if (fit == by_size_.end()) return std::nullopt;
  const auto [extent_size, offset] = *fit;
  Erase(by_offset_.find(offset));
  if (extent_size > need) Insert(offset + need, extent_size - need);
  free_bytes_ -= need;
  return offset;
}

std::optional<uint64_t> ExtentAllocator::AllocateAligned(uint64_t size, uint64_t align) {
  assert(align % alignment_ == 0);
  if (align <= alignment_) return Allocate(size);
  const uint64_t need = RoundUp(size);
  // The smallest free extent that holds an aligned run of `need` bytes. Extents at least
  // need + align - alignment always do, so the scan ends there at the latest.
  for (auto it = by_size_.lower_bound({need, 0}); it != by_size_.end(); ++it) {
    const auto [extent_size, offset] = *it;
    const uint64_t start = (offset + align - 1) / align * align;
    if (start + need > offset + extent_size) continue;
    Erase(by_offset_.find(offset));
    if (start > offset) Insert(offset, start - offset);
    if (offset + extent_size > start + need)
      Insert(start + need, offset + extent_size - start - need);
    free_bytes_ -= need;
    return start;
  }
  return std::nullopt;
}

bool ExtentAllocator::AllocateAt(uint64_t offset, uint64_t size) {
  const uint64_t need = RoundUp(size);
  if (offset % alignment_ != 0 || offset + need > capacity_) return false;
  auto it = by_offset_.upper_bound(offset);
  if (it == by_offset_.begin()) return false;
  --it;
  const auto [free_off, free_size] = *it;
  if (free_off + free_size < offset + need) return false;
  Erase(it);
  if (offset > free_off) Insert(free_off, offset - free_off);
  if (free_off + free_size > offset + need) {
    Insert(offset + need, free_off + free_size - offset - need);
  }
  free_bytes_ -= need;
  return true;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t size) {
  uint64_t begin = offset;
  uint64_t end = offset + RoundUp(size);
  assert(end <= capacity_ && begin % alignment_ == 0);
  free_bytes_ += end - begin;

  auto next = by_offset_.lower_bound(begin);
  assert(next == by_offset_.end() || next->first >= end);  // no double free
  if (next != by_offset_.end() && next->first == end) {
    end += next->second;
    auto after = std::next(next);
    Erase(next);
    next = after;
  }
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= begin);  // no double free
    if (prev->first + prev->second == begin) {
      begin = prev->first;
      Erase(prev);
    }
  }
  Insert(begin, end - begin);
}

uint64_t ExtentAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

void ExtentAllocator::Insert(uint64_t offset, uint64_t size) {
  by_offset_.emplace(offset, size);
  by_size_.emplace(size, offset);
}

void ExtentAllocator::Erase(std::map<uint64_t, uint64_t>::iterator it) {
  by_size_.erase({it->second, it->first});
  by_offset_.erase(it);
}

}  // namespace tierd::daemon
