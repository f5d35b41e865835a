// The two lanes a StepWorker steps groups through (optimizer_worker.h's Lane).
//
// HostLane (optimizer_host_lane.cc): a group's shards stepped by the CPU kernels. State at home on
// NVMe streams through the read-ahead window (read ahead of its turn at the pace the lane
// measured, pinned for its step, written back) unless it is resident in the host tier; state at
// home on the host stays pinned.
//
// DeviceLane (optimizer_device.cc): a group placed on the device is stepped shard by shard in the
// daemon's device tier, each shard acquired there one ahead of its turn and sent home after.
#pragma once

#include <memory>
#include <vector>

#include "client/device_kernels.h"
#include "client/optimizer_worker.h"
#include "client/read_ahead.h"
#include "kernels/cpu_adam.h"

namespace tierd::internal {

class HostLane : public Lane {
 public:
  // `state` and `window` outlive the lane; `threads` run the kernels (0: one per CPU).
  HostLane(StateRecord& state, ReadAheadWindow& window, int threads);

  absl::Status Step(const Work& w, const ExpectedShards& expected, OptimizerStepStats* delta,
                    bool* skipped) override;
  absl::Status ReadAhead(size_t g, size_t k, size_t in_hand,
                         const ExpectedShards& expected) override;
  // Also measures the pace a shard took this step, for the next step's read-ahead.
  absl::Status Settle() override;
  bool on_device() const override { return false; }

 private:
  StateRecord& state_;
  ReadAheadWindow& window_;
  std::unique_ptr<kernels::ThreadPool> pool_;
  // The lane's time on shards this step (waiting for them included), and how many it stepped:
  // written by the worker's thread during a step, read by Settle once it is idle.
  absl::Duration shard_time_;
  size_t shards_stepped_ = 0;
  // How long a shard took last step: the read-ahead says when each shard is needed, so that the
  // daemon serves write-backs (which free the budget) before reads needed later. Zero until a
  // step has been measured: everything is then due at once.
  absl::Duration pace_;
};

class DeviceLane : public Lane {
 public:
  // `state` outlives the lane; `device` steps its groups.
  DeviceLane(StateRecord& state, std::unique_ptr<DeviceKernels> device);

  absl::Status Step(const Work& w, const ExpectedShards& expected, OptimizerStepStats* delta,
                    bool* skipped) override;
  // The device lane reads nothing ahead: each shard is acquired one ahead of its turn.
  absl::Status ReadAhead(size_t, size_t, size_t, const ExpectedShards&) override {
    return absl::OkStatus();
  }
  // Waits for the shards' moves home.
  absl::Status Settle() override;
  bool on_device() const override { return true; }

 private:
  StateRecord& state_;
  std::unique_ptr<DeviceKernels> device_;
  std::vector<CompletionToken> homeward_;  // the shards going home
};

}  // namespace tierd::internal
