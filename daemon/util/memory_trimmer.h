// Hands memory that the daemon freed back to the kernel. glibc's malloc keeps what a thread frees
// in that thread's arena (up to 8 per core), for that arena's next allocations: parsing a large
// request (up to 32 MiB of protobuf, hundreds of thousands of small objects) in one gRPC thread
// and another in the next leaves each arena holding its peak. Under hostile traffic the daemon's
// resident set grew by hundreds of MiB that way with nothing leaked (docs/benchmarks.md). What a
// request frees is not told by its size: a chunk is a few bytes in an Allocate or a Free and a
// few hundred in the daemon, so 100,000 of them come and go in requests under a MiB and leave
// tens of MiB in the arenas. So every finished request and every ended session is noted (Note,
// lock-free), and a thread of this class trims every arena (malloc_trim) at most once an
// interval, and only after something was noted: a quiet daemon never trims, and a flood of
// requests makes it trim no more often than that.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace tierd::daemon {

class MemoryTrimmer {
 public:
  // Trims run at most every `interval`.
  explicit MemoryTrimmer(absl::Duration interval);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // Work that may have freed memory has finished: a request (once gRPC freed its messages) or a
  // session (any thread). Read before written, so that busy threads do not fight over the line.
  void Note() {
    if (!pending_.load(std::memory_order_relaxed)) pending_.store(true, std::memory_order_relaxed);
  }
  uint64_t trims() const { return trims_.load(std::memory_order_relaxed); }

  // Bounds glibc's arenas, fixes its mmap threshold (which otherwise grows to the largest buffer
  // freed, moving later large buffers into the arenas) and turns off its fastbins (so that what
  // is freed at an arena's end goes back at once; malloc_trim cannot return it). Call first thing
  // in main(), before any thread starts.
  static void ConfigureAllocator();

 private:
  void Run();

  const absl::Duration interval_;
  std::atomic<bool> pending_{false};
  std::atomic<uint64_t> trims_{0};
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace tierd::daemon
