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
  // No fastbins: small frees coalesce at once. malloc_trim releases free pages inside an arena
  // and the main arena's top, but never the top of another arena; only free() shrinks that, when a
  // chunk it frees joins the top. A fastbin chunk joins it later, in a consolidation that shrinks
  // nothing: 100,000 chunks freed by one request left 23 MiB in such a top, resident for good, one
  // run in three on a loaded machine. (The per-thread cache in front of the arenas stays.)
  mallopt(M_MXFAST, 0);
#endif
}

}  // namespace tierd::daemon
