// A thread that runs tasks in order. The NVMe tier uses one for the work around its I/O that must
// not run on gRPC threads or the I/O engine's thread: checksums and index commits.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace tierd::daemon {

class WorkQueue {
 public:
  WorkQueue() : thread_([this] { Loop(); }) {}
  // Runs every task already posted, then stops.
  ~WorkQueue() {
    Post(nullptr);
    thread_.join();
  }
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
    ++posted_;
  }

  // Waits until every task posted so far has run.
  void Drain() {
    absl::MutexLock lock(&mu_);
    std::pair<WorkQueue*, uint64_t> arg(this, posted_);
    mu_.Await(absl::Condition(
        +[](std::pair<WorkQueue*, uint64_t>* a)
             ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->first->ran_ >= a->second; },
        &arg));
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](std::deque<std::function<void()>>* q) { return !q->empty(); }, &tasks_));
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      if (!task) return;
      task();
      absl::MutexLock lock(&mu_);
      ++ran_;
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t posted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ran_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace tierd::daemon
