// Hands memory that requests freed back to the kernel. glibc's malloc keeps what a thread frees
// in that thread's arena (up to 8 per core), for that arena's next allocations: parsing a large
// request (up to 32 MiB of protobuf, hundreds of thousands of small objects) in one gRPC thread
// and another in the next leaves each arena holding its peak. Under hostile traffic the daemon's
// resident set grew by hundreds of MiB that way with nothing leaked (docs/benchmarks.md). The
// request path notes each large request (Note, lock-free); a thread of this class trims every
// arena (malloc_trim) at most once an interval, and only after large requests, so neither a
// quiet daemon nor a flood of large requests makes it trim more often than that.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace tierd::daemon {

class MemoryTrimmer {
 public:
  // Requests of at least `large_bytes` count; trims run at most every `interval`.
  MemoryTrimmer(uint64_t large_bytes, absl::Duration interval);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // A request of `bytes` was parsed (any thread).
  void Note(uint64_t bytes) {
    if (bytes >= large_bytes_) pending_.store(true, std::memory_order_relaxed);
  }
  uint64_t trims() const { return trims_.load(std::memory_order_relaxed); }

  // Bounds glibc's arenas and fixes its mmap threshold (which otherwise grows to the largest
  // buffer freed, moving later large buffers into the arenas). Call first thing in main(),
  // before any thread starts.
  static void ConfigureAllocator();

 private:
  void Run();

  const uint64_t large_bytes_;
  const absl::Duration interval_;
  std::atomic<bool> pending_{false};
  std::atomic<uint64_t> trims_{0};
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace tierd::daemon
