// The out-of-core optimizer's workers: each one thread that steps the groups the coordinator queues
// to it, in the order queued, shard by shard. The host lane's shards are read ahead or pinned in
// the host tier, stepped by the CPU kernels and written back, and it keeps the read-ahead window
// filled with the shards expected next, at the pace it measured. The device lane's are acquired in
// the device tier one ahead of their turn (the daemon brings them up through the host), stepped
// there by the device kernels and sent home again. A worker decides nothing of a step: what is
// stepped, with which options and flags, comes in each Work; the first error is kept for the
// coordinator's FinishStep.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/device_kernels.h"
#include "client/optimizer_state.h"
#include "client/read_ahead.h"
#include "kernels/cpu_adam.h"
#include "tierd/optimizer.hpp"

namespace tierd::internal {

// Bytes of one value of `t`, and the kernels' name for it.
size_t ElementBytes(ScalarType t);
kernels::DType ToDType(ScalarType t);
// The fp32 master weights of `shard` of `group`, whose state is at `base`: the state's p region,
// or, for a group whose master is its out, the step's out at the shard's first parameter.
float* MasterOf(const Group& group, const Shard& shard, char* base, const GroupStep& step);
// The kernels' tensor for `piece` of group `group` (index g)'s shard k, whose state is at `base`,
// stepped with `step`'s gradients and out (an fp32 out is copied from the weights instead).
kernels::AdamTensor PieceTensor(const Group& group, size_t g, size_t k, const Piece& piece,
                                char* base, const GroupStep& step, ScalarType state_type);
// Adds a group's (or a lane's) figures of a step to `into`'s.
void AddStepStats(const OptimizerStepStats& from, OptimizerStepStats* into);
// The gradients of the tensors `step` steps (the others' may hold anything), for the non-finite
// check.
std::vector<kernels::AdamTensor> SteppedGradients(const Group& group, const GroupStep& step);

// One group's part of a step, as the coordinator queues it.
struct Work {
  size_t group = 0;
  GroupStep step;                // step.tensors: one flag per tensor, valid until the step ends
  kernels::AdamOptions options;  // the group's hyperparameters and loss scale, this step
  int64_t number = 0;            // the step being taken, counting from 1
};

class StepWorker {
 public:
  // The host lane: `state` and `window` outlive the worker; `threads` run the kernels (0: one per
  // CPU).
  StepWorker(StateRecord& state, ReadAheadWindow& window, int threads);
  // The device lane: the groups placed on the device, stepped by `device`.
  StepWorker(StateRecord& state, ReadAheadWindow& window, std::unique_ptr<DeviceKernels> device);
  ~StepWorker();  // stops the thread (once what is queued is taken)
  StepWorker(const StepWorker&) = delete;
  StepWorker& operator=(const StepWorker&) = delete;

  // A step begins: no error, no figures yet, no group started. REQUIRES: nothing outstanding.
  void Begin();
  // Queues one group's work; `touched`: which of its shards the work reads or writes (what the
  // read-ahead expects of the group's next step too).
  void Enqueue(Work work, std::vector<uint8_t> touched);
  // Waits until the worker is done with group `g`'s work this step (its gradients and `out` are
  // no longer read or written), at most `timeout`: OK, DEADLINE_EXCEEDED, or FAILED_PRECONDITION
  // when it was not queued this step or the worker stops. Any thread.
  absl::Status WaitFor(size_t g, absl::Duration timeout);
  // The end of a step, finished or abandoned: waits for the worker to take every queued group,
  // drops what was read ahead for groups not given and waits for every write-back (the device
  // lane: for its shards to reach their home). Returns the time the last two took (write wait), or
  // the first error of either.
  absl::StatusOr<absl::Duration> Settle();
  // After Settle: the step's figures and its first error; the pace a shard is measured from it.
  OptimizerStepStats Collect(absl::Status* error);
  // The step is over: every group is expected again.
  void End();
  // Fills the budget's free room with read-ahead of the shards expected after group `g`'s shard
  // `k` (g npos: before any group), `in_hand` shards being pinned now.
  absl::Status ReadAhead(size_t g, size_t k, size_t in_hand);
  // The groups were added to: their bookkeeping sized anew. REQUIRES: between steps.
  void Resize();
  // Groups were removed: `index` maps each old group to its new index (npos: removed).
  void Reindex(const std::vector<size_t>& index);

  // The order the read-ahead expects the groups in: the last complete step's. The driving
  // thread's between steps; the worker reads it while a step runs.
  std::vector<size_t> expected_order;

 private:
  void Run();
  absl::Status StepOne(const Work& w, OptimizerStepStats* delta, bool* skipped);
  // The device lane's StepOne (optimizer_device.cc).
  absl::Status StepOnDevice(const Work& w, OptimizerStepStats* delta, bool* skipped);
  // The device lane's Settle after the queue is empty: its shards' moves home, waited for.
  absl::Status WaitHomeward();
  // The shards expected to be stepped next, in order: the rest of group `g` from shard `k` (none
  // when g is npos), the groups queued, then the groups not given yet in last step's order.
  std::vector<ChunkId> Expected(size_t g, size_t k, size_t want);

  StateRecord& state_;
  ReadAheadWindow& window_;
  std::unique_ptr<kernels::ThreadPool> pool_;  // the host lane's
  std::unique_ptr<DeviceKernels> device_;      // the device lane's
  std::vector<CompletionToken> homeward_;      // the device lane's shards going home
  absl::Mutex mu_;
  std::deque<Work> queue_ ABSL_GUARDED_BY(mu_);
  size_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> started_ ABSL_GUARDED_BY(mu_);  // groups the worker has taken this step
  std::vector<bool> queued_ ABSL_GUARDED_BY(mu_);   // groups queued this step
  std::vector<bool> done_ ABSL_GUARDED_BY(mu_);     // groups the worker is done with this step
  // Each group's shards that its last step read or wrote: the read-ahead expects the same of the
  // next step, so that shards of frozen tensors are not brought up for nothing.
  std::vector<std::vector<uint8_t>> touched_ ABSL_GUARDED_BY(mu_);
  OptimizerStepStats stats_ ABSL_GUARDED_BY(mu_);
  // The worker's time on shards this step (waiting for them included), and how many it stepped.
  absl::Duration shard_time_ ABSL_GUARDED_BY(mu_);
  size_t shards_stepped_ ABSL_GUARDED_BY(mu_) = 0;
  // How long the worker took per shard last step: the read-ahead says when each shard is needed
  // by it, so that the daemon serves write-backs (which free the budget) before reads needed
  // later. Zero until a step has been measured: everything is then due at once. Written between
  // steps.
  absl::Duration pace_;
  std::thread thread_;
};

}  // namespace tierd::internal
