// The out-of-core optimizer's workers: each one thread that steps the groups the coordinator queues
// to it, in the order queued, through its lane (optimizer_lanes.h), which decides how a group's
// shards are stepped: the host lane's are read ahead or pinned in the host tier, stepped by the CPU
// kernels and written back; the device lane's are acquired in the device tier one ahead of their
// turn, stepped there by the device kernels and sent home again. A worker decides nothing of a
// step: what is stepped, with which options and flags, comes in each Work; the first error is kept
// for the coordinator's FinishStep. It keeps the step's bookkeeping (what was queued, taken and
// done) and the order the groups are expected in, which it tells its lane as the lane reads ahead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/optimizer_state.h"
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

// The shards a lane expects to step next, in order: the rest of group `g` from shard `k` (none
// when g is npos), the groups queued, then the groups not given yet in last step's order; at most
// `want` of them. The worker's answer to its lane's read-ahead.
using ExpectedShards = std::function<std::vector<ChunkId>(size_t g, size_t k, size_t want)>;

// How a worker steps a group: the host's CPU kernels or the device's (optimizer_lanes.h). Called
// on the worker's thread during a step (Step) and by the driving thread between steps (ReadAhead,
// Settle, once the worker is idle).
class Lane {
 public:
  virtual ~Lane() = default;
  // Steps one group's work, adding its figures to `delta`; `skipped`: its gradients were not
  // finite, so nothing of it changed. `expected` says what comes next, for the read-ahead.
  virtual absl::Status Step(const Work& w, const ExpectedShards& expected,
                            OptimizerStepStats* delta, bool* skipped) = 0;
  // Fills the read-ahead with the shards expected after group `g`'s shard `k` (g npos: before
  // any group), `in_hand` shards being pinned now. A lane that reads nothing ahead does nothing.
  virtual absl::Status ReadAhead(size_t g, size_t k, size_t in_hand,
                                 const ExpectedShards& expected) = 0;
  // The end of a step, the worker idle: what the lane still holds of the step goes (read-ahead
  // dropped, write-backs or moves home waited for); the first error.
  virtual absl::Status Settle() = 0;
  // Whether its busy time and parameters are the device's figures or the host's.
  virtual bool on_device() const = 0;
};

class StepWorker {
 public:
  // `state` outlives the worker.
  StepWorker(StateRecord& state, std::unique_ptr<Lane> lane);
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
  // then settles the lane (Lane::Settle). Returns the time the lane's settling took (write
  // wait), or its first error.
  absl::StatusOr<absl::Duration> Settle();
  // After Settle: the step's figures and its first error.
  OptimizerStepStats Collect(absl::Status* error);
  // The step is over: every group is expected again.
  void End();
  // Fills the lane's read-ahead with the shards expected after group `g`'s shard `k` (g npos:
  // before any group), `in_hand` shards being pinned now. Between steps.
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
  // ExpectedShards, from the queue and last step's order.
  std::vector<ChunkId> Expected(size_t g, size_t k, size_t want);

  StateRecord& state_;
  std::unique_ptr<Lane> lane_;
  const ExpectedShards expected_;  // Expected, for the lane
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
  std::thread thread_;  // last: it starts once everything above is made
};

}  // namespace tierd::internal
