// A persistent pool of worker threads for the CPU kernels. Each worker is pinned to one CPU of
// the process's affinity set and keeps the same share of every job, so it touches the same memory
// step after step (and, with first-touch placement, memory on its own node). A job wakes the
// workers once and waits once: no thread is created or joined per job or per tile.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tierd::kernels {

class ThreadPool {
 public:
  // `threads` workers in all, the calling thread included (0: one per CPU the process may use).
  explicit ThreadPool(int threads = 0, bool pin = true);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }
  // Runs fn(i) for every worker i in [0, workers) (clamped to [1, size()]), the caller as worker
  // 0, and returns when all have returned; the other workers stay asleep. Not reentrant: one job
  // at a time.
  void Run(int workers, const std::function<void(int)>& fn);
  void RunOnAll(const std::function<void(int)>& fn) { Run(size_, fn); }

 private:
  void Worker(int index, int cpu);

  int size_ = 1;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  const std::function<void(int)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int active_ ABSL_GUARDED_BY(mu_) = 0;  // workers of the current job
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tierd::kernels
