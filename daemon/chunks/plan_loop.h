// The thread that runs the planner: a round every `interval` while any session has a schedule (it
// watches the sessions' cursors, which clients advance without an RPC), idle otherwise. A round
// that takes longer than `interval` is followed by a pause as long as itself, so that planning
// never takes more than half of a core however large the schedules are.
#pragma once

#include <algorithm>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon/chunks/chunk_service.h"

namespace tierd::daemon {

class PlanLoop {
 public:
  PlanLoop(ChunkService* chunks, absl::Duration interval)
      : thread_([this, chunks, interval] {
          absl::Duration pause = interval;
          while (!stop_.WaitForNotificationWithTimeout(pause)) {
            const absl::Time start = absl::Now();
            chunks->RunPlanningRound(start);
            pause = std::max(interval, absl::Now() - start);
          }
        }) {}
  ~PlanLoop() {
    stop_.Notify();
    thread_.join();
  }
  PlanLoop(const PlanLoop&) = delete;
  PlanLoop& operator=(const PlanLoop&) = delete;

 private:
  absl::Notification stop_;
  std::thread thread_;  // last: starts once stop_ exists
};

}  // namespace tierd::daemon
