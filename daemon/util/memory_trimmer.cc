#include "daemon/util/memory_trimmer.h"

#include <malloc.h>

namespace tierd::daemon {

MemoryTrimmer::MemoryTrimmer(absl::Duration interval)
    : interval_(interval), thread_([this] { Run(); }) {}

MemoryTrimmer::~MemoryTrimmer() {
  stop_.Notify();
  thread_.join();
}

void MemoryTrimmer::Run() {
  while (!stop_.WaitForNotificationWithTimeout(interval_)) {
    if (!pending_.exchange(false, std::memory_order_relaxed)) continue;
    malloc_trim(0);
    trims_.fetch_add(1, std::memory_order_relaxed);
  }
}

void MemoryTrimmer::ConfigureAllocator() {
#ifdef M_ARENA_MAX
  // The daemon's threads are gRPC's and the tiers' few own: a handful of arenas serves them
  // without contention, where glibc's default (8 per core) would keep 512 peaks on 64 cores.
  mallopt(M_ARENA_MAX, 4);
  // Buffers of a MiB and more (a large request's bytes) straight from mmap, and back at free.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
}

}  // namespace tierd::daemon
