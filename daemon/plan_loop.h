// The thread that runs the planner: a round every `interval` while any session has a schedule (it
// watches the sessions' cursors, which clients advance without an RPC), idle otherwise.
#pragma once

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon/chunk_service.h"

namespace tierd {

class PlanLoop {
 public:
  PlanLoop(ChunkService* chunks, absl::Duration interval)
      : thread_([this, chunks, interval] {
          while (!stop_.WaitForNotificationWithTimeout(interval)) chunks->PlanRound(absl::Now());
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

}  // namespace tierd
