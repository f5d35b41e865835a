// The out-of-core optimizer: Adam/AdamW whose state (fp32 master weights, m and v) lives in
// daemon chunks — at home on NVMe (or in the host tier), persistent by name so that training can
// resume — and streams through a bounded amount of host memory each step. While group i is being
// computed on the host mapping, the next shards' state is read ahead and the previous ones are
// written back: the optimizer keeps a window of prefetches and write-backs that fills its host
// budget exactly, in the order the groups came last step (between steps, the first shards of the
// next step come up while the caller runs forward and backward).
//
// Gradients arrive per parameter group, as the framework produces them during backward: StepGroup
// queues the group and returns, so the step of early groups overlaps the rest of backward.
//
//   auto opt = tierd::OffloadedAdam::Create(groups, {.name = "llama13b/adam"});
//   if (!(*opt)->resumed()) for (g...) (*opt)->SetParams(g, initial_weights[g]);
//   for (;;) {
//     (*opt)->BeginStep(loss_scale);
//     ... backward; as group g's gradients are ready:
//     (*opt)->StepGroup(g, grads[g], tierd::ScalarType::kBFloat16, weights16[g],
//                       tierd::ScalarType::kBFloat16);
//     auto stats = (*opt)->FinishStep();  // every group done; weights16 hold the new weights
//   }
//
// Thread safety: one thread drives an optimizer (BeginStep, StepGroup, FinishStep); the step
// itself runs on the optimizer's own threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tierd/client.hpp"

namespace tierd {

enum class ScalarType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// In double, as the frameworks keep them (1 - beta2 from a float 0.999 is 1.3e-5 off).
struct AdamHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // AdamW (decoupled decay, p *= 1 - lr * weight_decay) when true; Adam with L2 decay added to the
  // gradient, as torch.optim.Adam does, when false.
  bool adamw = true;
};

// A group of parameters stepped together (and streamed as one): one or more tensors laid end to
// end. Each tensor keeps its own count of steps, as torch keeps one per parameter: a tensor left
// out of a step (it had no gradient) keeps its weights, moments and step count, and its bias
// correction goes on from its own count when it is next stepped.
struct ParamGroup {
  std::string name;  // unique in the optimizer; letters, digits and '._-'
  uint64_t params = 0;
  // The tensors' sizes, summing to params (zeros allowed); empty: one tensor of params.
  std::vector<uint64_t> tensors;
  // Where the group's fp32 master weights live. kState: in the optimizer's state beside m and v.
  // kOut: they are each step's fp32 `out` itself — for weights the caller keeps in fp32 anyway
  // (a streamed unit's next version), so that the state holds m and v only and a step writes the
  // weights once, not twice. `out` then holds the weights on entry and receives the new ones; the
  // group is stepped on the host, and its state is scratch (persistent state must restore the
  // weights it resumes).
  enum class Master : int { kState = 0, kOut = 1 };
  Master master = Master::kState;
};

// One group's part of a step (StepGroup). `grad` holds the group's params values of grad_type (it
// may be null when no tensor is stepped); `out`, when not null, receives the stepped tensors' new
// weights as values of out_type. Both must stay valid until FinishStep returns.
struct GroupStep {
  const void* grad = nullptr;
  ScalarType grad_type = ScalarType::kFloat32;
  void* out = nullptr;
  ScalarType out_type = ScalarType::kBFloat16;
  // One byte per tensor of the group, of TensorFlag bits; empty: every tensor is stepped.
  std::span<const uint8_t> tensors;
  // fp32 weights, params values, read for the tensors flagged kTensorTakeWeights.
  const float* weights = nullptr;
};
enum TensorFlag : uint8_t {
  // The tensor has a gradient this step: Adam updates it and its step count grows by one.
  // Without it the tensor is left exactly as it is.
  kTensorStep = 1,
  // Before anything else, the tensor's master weights become `GroupStep::weights` (the caller
  // changed the weights since the last step: a clamp, a load, an averaging swap).
  kTensorTakeWeights = 2,
};

struct OffloadedAdamOptions {
  // The optimizer's own session with the daemon (its schedule and bandwidth share are its own).
  ClientOptions client;
  // Names the state chunks: "<name>/<group>/<shard>" and "<name>/meta".
  std::string name = "adam";
  // Where the state lives between steps: kNvme (streamed through the host) or kHost.
  Tier home = Tier::kNvme;
  // Persistent state outlives the process (and the daemon): Create with the same name and groups
  // resumes it. Scratch state (false) is freed when the optimizer is destroyed.
  bool persistent = true;
  // Discard persistent state found under `name` and start afresh (SetParams needed again).
  bool reset = false;
  // Persistent state: kCreate fails (ALREADY_EXISTS) when state of this name exists, kOpen
  // (resume) fails (NOT_FOUND) when none does; kCreateOrOpen resumes what it finds.
  enum class Open : int { kCreateOrOpen = 0, kCreate = 1, kOpen = 2 };
  Open open = Open::kCreateOrOpen;
  // Host-tier bytes the state may occupy at once (its read-ahead and write-back included).
  uint64_t host_budget_bytes = 1ull << 30;
  // Parameters per state chunk (12 bytes each, 8 with bf16 moments). 0: chosen so that the budget
  // holds 24 chunks, at most 4 Mi parameters and at most the largest chunk of which whole ones
  // fill the host tier's segments. INVALID_ARGUMENT when a chunk would not fit in one segment.
  uint64_t shard_params = 0;
  // The moments m and v: kFloat32, or kBFloat16 (a third less state to store and move each step;
  // rounded stochastically, see kernels/adam_types.h). The master weights stay fp32. Persistent
  // state is reopened with the type it was created with.
  ScalarType state_type = ScalarType::kFloat32;
  // Kernel threads (0: one per CPU this process may use).
  int threads = 0;
  // Keep two versions of each shard: a step reads the state's version and writes the other, which
  // becomes the state when the step finishes. A step can then be abandoned after groups were
  // stepped (AbandonStep: stepping speculatively, before the gradients' global norm is known), and
  // a step interrupted by a crash leaves the state as it was before it. Twice the state's space
  // in its home tier (and in the host budget, two shards in hand); the same bytes moved a step.
  bool speculative = false;
  // Check each group's gradients before applying them; a group with an infinite or NaN gradient
  // is left as it was and reported in the step's stats (the caller lowers its loss scale).
  bool check_finite = true;
  AdamHyperparameters hyper;
  // Device-tier bytes of state that the device lane (SetGroupPlace) keeps there from one step to
  // the next instead of sending it home after each step and bringing it up again: the shards it
  // steps last, as far as their bytes fit (both versions when speculative). Between steps the
  // daemon keeps them as it keeps any chunk, and writes one home only when the device tier needs
  // the room; reading the state (GetState, GetParams) or placing the group on the host brings it
  // down. Scratch state only: what FinishStep acknowledges of persistent state is at home.
  uint64_t device_budget_bytes = 0;
};

struct OptimizerStepStats {
  int64_t step = 0;                    // the step just taken, counting from 1 across resumptions
  absl::Duration wall;                 // BeginStep to the end of FinishStep
  absl::Duration compute;              // in the kernels
  absl::Duration state_wait;           // waiting for state to arrive in the host tier
  absl::Duration write_wait;           // waiting for write-backs (the budget, and the step's end)
  uint64_t state_bytes = 0;            // optimizer state the step touched
  std::vector<size_t> skipped_groups;  // groups whose gradients were not finite
  // Each lane (SetGroupPlace): the parameters it stepped, and the time it was busy with them,
  // waiting for their state included.
  uint64_t host_params = 0;
  absl::Duration host_busy;
  uint64_t device_params = 0;
  absl::Duration device_busy;
  // The state the device lane's step left in the device tier (device_budget_bytes; when
  // speculative, its other version stays there too).
  uint64_t device_kept_bytes = 0;
};

// Where a group is stepped (OffloadedAdam::SetGroupPlace).
enum class StepPlace : int {
  // By the CPU kernels, its state streamed through the host budget (or kept in the host tier).
  kHost = 0,
  // By the device's kernels: each step brings the group's state up into the daemon's device tier
  // (through the host), steps it there and sends it home again (or keeps it there, within
  // device_budget_bytes). Its gradients and `out` are memory the device reaches: device memory,
  // or pinned host memory the kernels read and write in place over the link (any host memory on
  // an emulated device); the weights it takes are host memory.
  kDevice = 1,
};

// The share of the parameters to step on the device that balances the two lanes, from the seconds
// each takes per parameter: each then takes as long. The lanes run side by side during backward,
// so the longer of the two is what a step waits for.
double BalancedDeviceShare(double host_seconds_per_param, double device_seconds_per_param);

class OffloadedAdam {
 public:
  // Opens a session and allocates (or opens) the state; resumed state starts coming up at once.
  // INVALID_ARGUMENT for bad groups or options (naming them); FAILED_PRECONDITION when persistent
  // state of that name has other groups or another state type; DATA_LOSS when its last step did not
  // finish and was not speculative (the state is partly updated: resume from a checkpoint, or set
  // `reset`).
  static absl::StatusOr<std::unique_ptr<OffloadedAdam>> Create(std::span<const ParamGroup> groups,
                                                               const OffloadedAdamOptions& options);
  ~OffloadedAdam();
  OffloadedAdam(const OffloadedAdam&) = delete;
  OffloadedAdam& operator=(const OffloadedAdam&) = delete;

  bool resumed() const;  // the state came from an earlier run
  int64_t steps_taken() const;
  size_t group_count() const;
  uint64_t shard_params() const;
  uint64_t state_bytes() const;  // of all groups (12 or 8 bytes per parameter, page-rounded)
  bool initialized(size_t group) const;
  Client& client();

  // Sets a group's fp32 master weights (`values` holds its params values) and zeroes its m and v.
  absl::Status SetParams(size_t group, std::span<const float> values);
  // Reads a group's fp32 master weights.
  absl::Status GetParams(size_t group, std::span<float> out);
  // Sets a group's whole state: weights, first and second moments (each of its params values;
  // empty m or v: zero; rounded to nearest for bf16 moments). What a checkpoint loads.
  absl::Status SetState(size_t group, std::span<const float> params, std::span<const float> m,
                        std::span<const float> v);
  // Reads one part of a group's state (a checkpoint's export), in fp32 whatever the state type.
  enum class Part : int { kParams = 0, kM = 1, kV = 2 };
  absl::Status GetState(size_t group, Part part, std::span<float> out);
  // Sets the count of steps taken, and every tensor's step count to it (the bias correction's
  // step is the next one): loading a checkpoint taken elsewhere. Not during a step.
  absl::Status SetStepsTaken(int64_t steps);
  // Each tensor's count of steps (torch's per-parameter "step"): `out` or `steps` has one value
  // per tensor of the group. Setting them is loading a checkpoint; not during a step.
  absl::Status GetTensorSteps(size_t group, std::span<int64_t> out) const;
  absl::Status SetTensorSteps(size_t group, std::span<const int64_t> steps);

  // Groups added after Create (torch's add_param_group), after the existing ones in the order
  // given, each without weights until SetParams or SetState; persistent state records them, so
  // that a Create with the whole list resumes them. Removed groups' state is freed; the others
  // keep their order (a group's index is its place in that order). Not during a step.
  absl::Status AddGroups(std::span<const ParamGroup> groups);
  absl::Status RemoveGroups(std::span<const size_t> groups);
  // Where group `group` is stepped from the next step on (kHost at first). kDevice needs the
  // daemon's device tier, fp32 moments, and, on a GPU, a client library built with CUDA:
  // FAILED_PRECONDITION otherwise. Not during a step.
  absl::Status SetGroupPlace(size_t group, StepPlace place);
  StepPlace group_place(size_t group) const;
  // The share of the parameters that would balance the lanes (BalancedDeviceShare), from the rates
  // measured over the last steps (each step's counting half); -1 until both lanes have stepped.
  double DeviceShare() const;

  // Takes effect from the next BeginStep (learning-rate schedules): every group's rate.
  void SetLearningRate(double lr);
  double learning_rate() const;
  // One group's hyperparameters, from the next BeginStep (a framework's parameter groups each
  // have their own); SetLearningRate later overrides their lr again.
  absl::Status SetGroupHyperparameters(size_t group, const AdamHyperparameters& hyper);

  // Starts a step. Gradients arrive multiplied by grad_scale (loss scaling; 1 for none).
  absl::Status BeginStep(float grad_scale = 1.0f);
  // Queues group `group`'s step and returns (see GroupStep). Each group once per step. A shard
  // whose tensors are neither stepped nor given weights is not read or written at all.
  absl::Status StepGroup(size_t group, const GroupStep& step);
  // Every tensor of the group stepped: grad holds params values of grad_type; out, when not
  // null, receives the new weights as params values of out_type (kBFloat16 or kFloat16, or
  // kFloat32).
  absl::Status StepGroup(size_t group, const void* grad, ScalarType grad_type, void* out = nullptr,
                         ScalarType out_type = ScalarType::kBFloat16);
  // Waits until group `group`'s queued step is done with its gradients and `out` (they may be
  // released or reused from then on; the state's write-back may still run), at most `timeout`:
  // OK, DEADLINE_EXCEEDED, or FAILED_PRECONDITION when the group was not queued this step. Unlike
  // the rest, any thread may call it while another drives the step.
  absl::Status WaitGroup(size_t group, absl::Duration timeout);
  // Speculative optimizers: waits for the queued groups and discards what they computed, leaving
  // every group's state as it was at BeginStep; the step is not counted (begin it again to redo
  // it). FAILED_PRECONDITION outside a step or when not speculative.
  absl::Status AbandonStep();
  // Waits for every queued group and for their state to reach its home tier, and records the step
  // as finished. Groups and tensors not stepped are left as they were. The first error of the step,
  // if any (the step is then not counted, and the state of the groups it reached is updated).
  absl::StatusOr<OptimizerStepStats> FinishStep();

  struct Impl;

 private:
  explicit OffloadedAdam(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tierd
