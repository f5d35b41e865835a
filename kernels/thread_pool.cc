#include "kernels/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>

namespace tierd::kernels {
namespace {

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(-1);  // unknown: leave threads unpinned
  return cpus;
}

void PinTo(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
}

}  // namespace

ThreadPool::ThreadPool(int threads, bool pin) {
  const std::vector<int> cpus = AllowedCpus();
  size_ = threads > 0 ? threads : static_cast<int>(cpus.size());
  auto cpu_of = [&](int i) { return pin ? cpus[static_cast<size_t>(i) % cpus.size()] : -1; };
  for (int i = 1; i < size_; ++i) {
    threads_.emplace_back([this, i, cpu = cpu_of(i)] { Worker(i, cpu); });
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::Run(int workers, const std::function<void(int)>& fn) {
  workers = std::clamp(workers, 1, size_);
  if (workers == 1) {  // nothing to wake
    fn(0);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_ = &fn;
    active_ = workers;
    pending_ = workers - 1;
    ++generation_;
  }
  fn(0);
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* pending) { return *pending == 0; }, &pending_));
  job_ = nullptr;
}

void ThreadPool::Worker(int index, int cpu) {
  PinTo(cpu);
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      absl::MutexLock lock(&mu_);
      // A job for fewer workers leaves this one asleep (its `seen` stays behind, harmlessly: the
      // next job that includes it has a newer generation still).
      struct Wait {
        ThreadPool* pool;
        uint64_t seen;
        int index;
      } wait{this, seen, index};
      mu_.Await(absl::Condition(
          +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->pool->stopping_ ||
                   (w->pool->generation_ != w->seen && w->index < w->pool->active_);
          },
          &wait));
      if (stopping_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(index);
    absl::MutexLock lock(&mu_);
    --pending_;
  }
}

}  // namespace tierd::kernels
