// OffloadedAdam: the step's coordinator over the state record (optimizer_state.h) and the worker
// (optimizer_worker.h). It validates each call, carries the step protocol (BeginStep, StepGroup,
// AbandonStep, FinishStep) and applies a step's outcome to the record.
//
// Who decides what: the framework above (tierd.torch.OffloadedAdamW) decides every step —
// which groups and tensors are stepped, with which hyperparameters and loss scale, whether a step
// is speculative, and whether to abandon it (its clip, skip and speculation verdict). This layer
// runs what it is told, exactly and durably: a speculative step's versions flip only in
// FinishStep, an abandoned one leaves the state as it was, and the meta chunk records a running
// step so that a crash during one is detected at the next Open.
#include "tierd/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/adam_hyper.h"
#include "client/optimizer_state.h"
#include "client/optimizer_worker.h"
#include "client/read_ahead.h"

namespace tierd {
namespace {

using internal::Group;
using internal::PiecesOf;
using internal::Shard;
using internal::ShardOf;
using internal::StateBytesPerParam;

// Shards the budget holds when the caller leaves the size to the optimizer: enough that reads and
// write-backs overlap in a deep queue (tierd-bench offload-step: 8 shards in a 286 MiB budget took
// 0.94 s a step, 23 shards 0.74-0.81 s), at most 4 Mi parameters (48 MiB) each.
constexpr uint64_t kAutoShards = 24;
constexpr uint64_t kMaxAutoShardParams = 4ull << 20;
constexpr uint64_t kMinShardParams = 16 * 1024;

bool ValidScalarType(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kBFloat16 || t == ScalarType::kFloat16;
}

absl::Status ValidateHyperparameters(const AdamHyperparameters& h) {
  if (!(h.lr >= 0) || !(h.beta1 >= 0 && h.beta1 < 1) || !(h.beta2 >= 0 && h.beta2 < 1) ||
      !(h.eps > 0) || !(h.weight_decay >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Adam hyperparameters out of range: lr ", h.lr, " (>= 0), betas ", h.beta1, ", ", h.beta2,
        " (in [0, 1)), eps ", h.eps, " (> 0), weight_decay ", h.weight_decay, " (>= 0)"));
  }
  return absl::OkStatus();
}

}  // namespace

struct OffloadedAdam::Impl {
  ~Impl() {
    // The threads stop before the window and the record they use.
    device_lane.reset();
    worker.reset();
    (void)window.WaitWrites(0);
  }

  // The budget is counted in shards of the largest size: the one in hand, those read ahead and
  // those being written back share it. Also the worker's bookkeeping sized by the groups.
  void Resize() {
    uint64_t largest = 0;
    state.state_bytes = 0;
    for (const Group& group : state.groups) {
      for (const Shard& sh : group.shards) {
        state.state_bytes += sh.bytes();
        largest = std::max(largest, sh.bytes());
      }
    }
    if (largest == 0) largest = ShardOf(0, state.shard_params, state.options.state_type).bytes();
    const uint64_t slots = std::max<uint64_t>(1, state.options.host_budget_bytes / largest);
    window.set_slots(slots - PlanResidency(slots));
    worker->Resize();
    if (device_lane != nullptr) device_lane->Resize();
  }

  // Scratch state at home on NVMe leaves what the budget holds beyond a window for the rest in
  // the host tier from one step to the next, rather than writing it down and reading it up
  // again each step: the shards stepped last (the host lane's, from the end of the expected
  // order), so that the step's tail after backward waits for none of them. They are pinned
  // during their step only: between steps the daemon keeps them as it keeps any chunk, and
  // writes one down only when another needs its room. Persistent state streams whole: what
  // FinishStep acknowledged is on NVMe. Returns the slots the resident shards take.
  uint64_t PlanResidency(uint64_t slots) {
    const uint64_t per_shard = state.options.speculative ? 2 : 1;
    // The window the streamed shards need: the shards in hand, one read ahead and one written
    // back at the least; a quarter of the budget when that is more.
    const uint64_t window = std::max<uint64_t>(per_shard + 2, slots / 4);
    uint64_t room = state.nvme_home() && !state.options.persistent && slots > window
                        ? (slots - window) / per_shard
                        : 0;
    // The order the groups are stepped in: the expected one, then any it does not name yet.
    std::vector<size_t> order;
    std::vector<bool> listed(state.groups.size(), false);
    for (size_t g : worker->expected_order) {
      if (g < listed.size() && !listed[g]) order.push_back(g), listed[g] = true;
    }
    for (size_t g = 0; g < listed.size(); ++g) {
      if (!listed[g]) order.push_back(g);
    }
    uint64_t resident = 0;
    for (auto g = order.rbegin(); g != order.rend(); ++g) {
      Group& group = state.groups[*g];
      for (auto sh = group.shards.rbegin(); sh != group.shards.rend(); ++sh) {
        sh->resident = !group.on_device && resident < room;
        resident += sh->resident ? 1 : 0;
      }
    }
    return resident * per_shard;
  }

  // The lane that steps group g.
  internal::StepWorker& lane(size_t g) {
    return state.groups[g].on_device ? *device_lane : *worker;
  }
  // Both lanes, the device's when there is one.
  std::vector<internal::StepWorker*> lanes() {
    std::vector<internal::StepWorker*> all{worker.get()};
    if (device_lane != nullptr) all.push_back(device_lane.get());
    return all;
  }
  // The device lane, made the first time a group is placed on the device: the kernels of the
  // daemon's device, emulated or a GPU.
  absl::Status OpenDeviceLane() {
    if (device_lane != nullptr) return absl::OkStatus();
    absl::StatusOr<NodeInfo> info = client->GetNodeInfo();
    if (!info.ok()) return info.status();
    if (info->device_uuid.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a group stepped on the device needs the daemon's device tier: ", info->device_status));
    }
    std::unique_ptr<internal::DeviceKernels> kernels;
    if (info->device_emulated) {
      kernels = internal::MakeEmulatedKernels(state.options.threads);
    } else {
      absl::StatusOr<int> ordinal = client->CudaDevice();
      if (!ordinal.ok()) return ordinal.status();
      absl::StatusOr<std::unique_ptr<internal::DeviceKernels>> cuda =
          internal::MakeCudaKernels(*ordinal);
      if (!cuda.ok()) return cuda.status();
      kernels = std::move(*cuda);
    }
    device_lane = std::make_unique<internal::StepWorker>(state, window, std::move(kernels));
    device_lane->Resize();
    return absl::OkStatus();
  }

  std::unique_ptr<Client> client;  // outlives the record, the window and the worker
  internal::StateRecord state;
  internal::ReadAheadWindow window;  // the host budget's shards read ahead and written back
  std::unique_ptr<internal::StepWorker> worker;       // the host lane
  std::unique_ptr<internal::StepWorker> device_lane;  // null until a group is placed there
  // Each lane's seconds per parameter over the last steps (each step's counting half); 0 until
  // measured.
  double host_rate = 0;
  double device_rate = 0;
  double lr = 0;
  std::vector<AdamHyperparameters> hyper;  // each group's

  // The end of a step: both lanes settled; the longer wait for write-backs, or the first error.
  absl::StatusOr<absl::Duration> Settle() {
    absl::StatusOr<absl::Duration> host = worker->Settle();
    if (device_lane == nullptr) return host;
    absl::StatusOr<absl::Duration> device = device_lane->Settle();
    if (!host.ok()) return host;
    if (!device.ok()) return device;
    return std::max(*host, *device);
  }
  // Each lane's rate, from a step that stepped enough of it to be measured.
  void Measure(const OptimizerStepStats& stats) {
    auto update = [](double* rate, absl::Duration busy, uint64_t params) {
      if (params == 0) return;
      const double now = absl::ToDoubleSeconds(busy) / static_cast<double>(params);
      *rate = *rate == 0 ? now : (*rate + now) / 2;
    };
    update(&host_rate, stats.host_busy, stats.host_params);
    update(&device_rate, stats.device_busy, stats.device_params);
  }

  // The step in progress (the driving thread's; the worker has what it needs in its Work).
  bool in_step = false;
  std::vector<kernels::AdamOptions> step_options;  // each group's, this step
  std::vector<bool> given;
  // Each group's TensorFlags this step (a copy of what StepGroup was given; every tensor stepped
  // when it was given none), which the worker reads through Work::step.
  std::vector<std::vector<uint8_t>> step_flags;
  std::vector<size_t> step_order;  // the order the groups came in this step
  absl::Time step_start;
};

OffloadedAdam::OffloadedAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadedAdam::~OffloadedAdam() = default;

absl::StatusOr<std::unique_ptr<OffloadedAdam>> OffloadedAdam::Create(
    std::span<const ParamGroup> specs, const OffloadedAdamOptions& options) {
  if (specs.empty()) return absl::InvalidArgumentError("an optimizer needs at least one group");
  std::vector<ParamGroup> groups(specs.begin(), specs.end());
  if (absl::Status s = internal::ValidateGroups(groups, {}, options.persistent); !s.ok()) return s;
  if (options.home != Tier::kHost && options.home != Tier::kNvme) {
    return absl::InvalidArgumentError("the optimizer's state lives on the host or NVMe tier");
  }
  if (options.name.empty()) return absl::InvalidArgumentError("the optimizer needs a name");
  if (options.reset && options.open == OffloadedAdamOptions::Open::kOpen) {
    return absl::InvalidArgumentError("reset discards the state that open would resume");
  }
  const AdamHyperparameters& h = options.hyper;
  if (absl::Status s = ValidateHyperparameters(h); !s.ok()) return s;
  if (options.state_type != ScalarType::kFloat32 && options.state_type != ScalarType::kBFloat16) {
    return absl::InvalidArgumentError(
        "state_type must be float32 or bfloat16 (float16 moments underflow: v is a square)");
  }

  auto impl = std::make_unique<Impl>();
  impl->state.options = options;
  impl->lr = h.lr;
  uint64_t shard_params = options.shard_params;
  if (shard_params == 0) {
    shard_params = std::clamp<uint64_t>(options.host_budget_bytes / kAutoShards /
                                            StateBytesPerParam(options.state_type) / 1024 * 1024,
                                        kMinShardParams, kMaxAutoShardParams);
  }
  impl->state.shard_params = shard_params;
  const uint64_t shard_bytes = ShardOf(0, shard_params, options.state_type).bytes();
  // The shards in hand (two for a speculative step), one read ahead and one written back.
  const uint64_t min_shards = options.speculative ? 4 : 3;
  if (options.home == Tier::kNvme && options.host_budget_bytes < min_shards * shard_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_budget_bytes ", options.host_budget_bytes, " holds fewer than ", min_shards,
        " shards of ", shard_params, " parameters (", shard_bytes,
        " bytes each): raise it to at least ", min_shards * shard_bytes, " or lower shard_params"));
  }
  for (ParamGroup& g : groups) impl->state.groups.push_back({.spec = std::move(g)});
  impl->hyper.assign(impl->state.groups.size(), h);

  ClientOptions client_options = options.client;
  if (client_options.client_name.empty()) client_options.client_name = "optimizer " + options.name;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  if (!client.ok()) return client.status();
  impl->client = std::move(*client);
  impl->state.client = impl->client.get();
  impl->window.Bind(impl->client.get(), options.home == Tier::kNvme);
  if (absl::Status s = impl->state.Open(); !s.ok()) return s;
  impl->worker = std::make_unique<internal::StepWorker>(impl->state, impl->window, options.threads);
  std::vector<size_t>& order = impl->worker->expected_order;  // before Resize, which reads it
  order.resize(impl->state.groups.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = g;
  impl->Resize();
  // Resuming: the first step's state comes up while the caller computes its gradients.
  const std::vector<Group>& groups_now = impl->state.groups;
  if (impl->state.resumed && std::all_of(groups_now.begin(), groups_now.end(),
                                         [](const Group& group) { return group.initialized; })) {
    if (absl::Status s = impl->worker->ReadAhead(std::string::npos, 0, 0); !s.ok()) return s;
  }
  return std::unique_ptr<OffloadedAdam>(new OffloadedAdam(std::move(impl)));
}

bool OffloadedAdam::resumed() const { return impl_->state.resumed; }
int64_t OffloadedAdam::steps_taken() const { return impl_->state.steps; }
size_t OffloadedAdam::group_count() const { return impl_->state.groups.size(); }
uint64_t OffloadedAdam::shard_params() const { return impl_->state.shard_params; }
uint64_t OffloadedAdam::state_bytes() const { return impl_->state.state_bytes; }
bool OffloadedAdam::initialized(size_t group) const {
  return group < impl_->state.groups.size() && impl_->state.groups[group].initialized;
}
Client& OffloadedAdam::client() { return *impl_->client; }
void OffloadedAdam::SetLearningRate(double lr) {
  impl_->lr = lr;
  for (AdamHyperparameters& h : impl_->hyper) h.lr = lr;
}
double OffloadedAdam::learning_rate() const { return impl_->lr; }

double BalancedDeviceShare(double host_seconds_per_param, double device_seconds_per_param) {
  if (!(host_seconds_per_param > 0) || !(device_seconds_per_param > 0)) {
    return host_seconds_per_param > 0 ? 1.0 : 0.0;  // a lane that costs nothing takes it all
  }
  // (1 - s) * host = s * device.
  return host_seconds_per_param / (host_seconds_per_param + device_seconds_per_param);
}

double OffloadedAdam::DeviceShare() const {
  if (impl_->host_rate == 0 || impl_->device_rate == 0) return -1;
  return BalancedDeviceShare(impl_->host_rate, impl_->device_rate);
}

StepPlace OffloadedAdam::group_place(size_t group) const {
  return group < impl_->state.groups.size() && impl_->state.groups[group].on_device
             ? StepPlace::kDevice
             : StepPlace::kHost;
}

absl::Status OffloadedAdam::SetGroupPlace(size_t group, StepPlace place) {
  Impl& d = *impl_;
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  if (place != StepPlace::kHost && place != StepPlace::kDevice) {
    return absl::InvalidArgumentError("SetGroupPlace: the place is kHost or kDevice");
  }
  if (d.in_step) return absl::FailedPreconditionError("SetGroupPlace during a step");
  Group& g = d.state.groups[group];
  if ((place == StepPlace::kDevice) == g.on_device) return absl::OkStatus();
  if (place == StepPlace::kHost) {
    g.on_device = false;
    d.Resize();  // its shards may be resident again
    return absl::OkStatus();
  }
  if (g.master_in_out()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.spec.name,
                     "' keeps its master weights in its out: it is stepped on the host"));
  }
  if (d.state.options.state_type != ScalarType::kFloat32) {
    return absl::FailedPreconditionError(
        "a group stepped on the device keeps fp32 moments (the GPU kernels have no bf16 ones): "
        "this optimizer's state_type is bfloat16");
  }
  if (absl::Status s = d.OpenDeviceLane(); !s.ok()) return s;
  // Its shards leave the host lane: nothing of theirs read ahead or kept pinned there.
  if (absl::Status s = d.window.Drop(); !s.ok()) return s;
  if (absl::StatusOr<absl::Duration> w = d.window.WaitWrites(0); !w.ok()) return w.status();
  for (const Shard& s : g.shards) {
    for (ChunkId id : {s.id, s.other}) {
      if (id == 0) continue;
      if (absl::Status st = d.state.Unkeep(id); !st.ok()) return st;
    }
  }
  g.on_device = true;
  d.Resize();  // its shards' room on the host goes to others
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetGroupHyperparameters(size_t group,
                                                    const AdamHyperparameters& hyper) {
  if (group >= impl_->state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", impl_->state.groups.size()));
  }
  if (absl::Status s = ValidateHyperparameters(hyper); !s.ok()) return s;
  impl_->hyper[group] = hyper;
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetStepsTaken(int64_t steps) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("SetStepsTaken during a step");
  if (steps < 0) return absl::InvalidArgumentError(absl::StrCat("steps ", steps, " < 0"));
  d.state.steps = steps;
  for (Group& g : d.state.groups) g.tensor_steps.assign(g.tensor_steps.size(), steps);
  return d.state.WriteMeta(false);
}

absl::Status OffloadedAdam::GetTensorSteps(size_t group, std::span<int64_t> out) const {
  const Impl& d = *impl_;
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  const Group& g = d.state.groups[group];
  if (out.size() != g.tensor_steps.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", g.spec.name, "' has ", g.tensor_steps.size(), " tensors, not ", out.size()));
  }
  std::copy(g.tensor_steps.begin(), g.tensor_steps.end(), out.begin());
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetTensorSteps(size_t group, std::span<const int64_t> steps) {
  Impl& d = *impl_;
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  if (d.in_step) return absl::FailedPreconditionError("SetTensorSteps during a step");
  Group& g = d.state.groups[group];
  if (steps.size() != g.tensor_steps.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", g.spec.name, "' has ", g.tensor_steps.size(), " tensors, not ", steps.size()));
  }
  for (int64_t s : steps) {
    if (s < 0) return absl::InvalidArgumentError(absl::StrCat("a tensor's steps ", s, " < 0"));
  }
  g.tensor_steps.assign(steps.begin(), steps.end());
  return d.state.WriteMeta(false);
}

absl::Status OffloadedAdam::AddGroups(std::span<const ParamGroup> specs) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("AddGroups during a step");
  std::vector<ParamGroup> added(specs.begin(), specs.end());
  if (absl::Status s = internal::ValidateGroups(added, d.state.groups, d.state.options.persistent);
      !s.ok())
    return s;
  const std::string what = absl::StrCat("optimizer state '", d.state.options.name, "'");
  // A group the state records but Create was not given is resumed, not made afresh.
  std::vector<Group> fresh;
  std::vector<bool> resuming;
  std::vector<size_t> taken;  // indexes in d.state.dormant
  for (ParamGroup& g : added) {
    fresh.push_back({.spec = std::move(g)});
    d.state.LayOut(fresh.back());
    auto r = std::find_if(d.state.dormant.begin(), d.state.dormant.end(),
                          [&](const internal::StateRecord::Recorded& x) {
                            return x.record.name == fresh.back().spec.name;
                          });
    resuming.push_back(r != d.state.dormant.end());
    if (r == d.state.dormant.end()) continue;
    if (absl::Status s = d.state.Adopt(fresh.back(), *r, what); !s.ok()) return s;
    taken.push_back(static_cast<size_t>(r - d.state.dormant.begin()));
  }
  const size_t first = d.state.groups.size();
  for (Group& g : fresh) d.state.groups.push_back(std::move(g));
  std::vector<ChunkSpec> chunk_specs;
  for (size_t g = first; g < d.state.groups.size(); ++g) {
    d.state.SpecifyChunks(g, resuming[g - first], &chunk_specs);
  }
  absl::StatusOr<std::vector<ChunkId>> ids = d.client->AllocateIds(chunk_specs);
  if (!ids.ok()) {
    d.state.groups.resize(first);
    return d.state.Lost(ids.status());
  }
  size_t i = 0;
  for (size_t g = first; g < d.state.groups.size(); ++g) {
    d.state.AssignChunks(d.state.groups[g], *ids, &i);
    AdamHyperparameters h = d.state.options.hyper;
    h.lr = d.lr;
    d.hyper.push_back(h);
    d.worker->expected_order.push_back(g);
  }
  std::sort(taken.begin(), taken.end());
  for (auto it = taken.rbegin(); it != taken.rend(); ++it) {
    d.state.dormant.erase(d.state.dormant.begin() + static_cast<ptrdiff_t>(*it));
  }
  d.Resize();
  return d.state.WriteMeta(false);
}

absl::Status OffloadedAdam::RemoveGroups(std::span<const size_t> which) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("RemoveGroups during a step");
  std::vector<bool> removed(d.state.groups.size(), false);
  for (size_t g : which) {
    if (g >= d.state.groups.size()) {
      return absl::OutOfRangeError(absl::StrCat("group ", g, " of ", d.state.groups.size()));
    }
    if (removed[g]) {
      return absl::InvalidArgumentError(absl::StrCat("group ", g, " is named twice"));
    }
    removed[g] = true;
  }
  // Nothing of theirs stays in the window or pinned; then the meta chunk stops naming them, and
  // only then are their chunks freed (a stop in between leaves chunks the next Open frees).
  if (absl::Status s = d.window.Drop(); !s.ok()) return s;
  if (absl::StatusOr<absl::Duration> w = d.window.WaitWrites(0); !w.ok()) return w.status();
  std::vector<ChunkId> freed;
  std::vector<Group> kept_groups;
  std::vector<AdamHyperparameters> kept_hyper;
  std::vector<size_t> index(d.state.groups.size(), std::string::npos);
  for (size_t g = 0; g < d.state.groups.size(); ++g) {
    if (!removed[g]) {
      index[g] = kept_groups.size();
      kept_groups.push_back(std::move(d.state.groups[g]));
      kept_hyper.push_back(d.hyper[g]);
      continue;
    }
    for (const Shard& s : d.state.groups[g].shards) {
      for (ChunkId id : {s.id, s.other}) {
        if (id == 0) continue;
        if (absl::Status st = d.state.Unkeep(id); !st.ok()) return st;
        freed.push_back(id);
      }
    }
  }
  d.state.groups = std::move(kept_groups);
  d.hyper = std::move(kept_hyper);
  for (internal::StepWorker* lane : d.lanes()) lane->Reindex(index);
  d.Resize();
  if (absl::Status s = d.state.WriteMeta(false); !s.ok()) return s;
  if (freed.empty()) return absl::OkStatus();
  return d.client->Free(freed);
}

absl::Status OffloadedAdam::SetParams(size_t group, std::span<const float> values) {
  return SetState(group, values, {}, {});
}

absl::Status OffloadedAdam::SetState(size_t group, std::span<const float> values,
                                     std::span<const float> m, std::span<const float> v) {
  Impl& d = *impl_;
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  if (d.in_step) return absl::FailedPreconditionError("SetState during a step");
  Group& g = d.state.groups[group];
  if (g.master_in_out() && !values.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", g.spec.name, "' keeps its master weights in its out: set m and v only"));
  }
  for (size_t n : {g.master_in_out() ? g.spec.params : values.size(),
                   m.empty() ? g.spec.params : m.size(), v.empty() ? g.spec.params : v.size()}) {
    if (n != g.spec.params) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", g.spec.name, "' has ", g.spec.params, " parameters, not ", n));
    }
  }
  if (absl::Status s = d.window.Drop(); !s.ok()) return s;
  for (const Shard& s : g.shards) {
    if (d.state.streams(s)) {
      if (absl::StatusOr<absl::Duration> w = d.window.MakeRoom(); !w.ok()) return w.status();
    }
    absl::StatusOr<void*> data = d.state.Pin(s.id, AccessMode::kOverwrite);
    if (!data.ok()) return data.status();
    // Each of p, m and v: the shard's values (m and v zero unless given), the page's tail zero.
    // bf16 moments are rounded to nearest.
    char* const base = static_cast<char*>(*data);
    std::memset(base, 0, s.bytes());
    if (!values.empty()) std::memcpy(base, values.data() + s.first, s.n * 4);
    for (auto [part, values_of] : {std::pair{Part::kM, m}, std::pair{Part::kV, v}}) {
      if (values_of.empty()) continue;
      char* at = base + s.offset(part);
      if (d.state.options.state_type == ScalarType::kBFloat16) {
        uint16_t* out = reinterpret_cast<uint16_t*>(at);
        for (uint64_t i = 0; i < s.n; ++i) out[i] = kernels::ToBF16(values_of[s.first + i]);
      } else {
        std::memcpy(at, values_of.data() + s.first, s.n * 4);
      }
    }
    if (absl::Status st = d.client->Release({&s.id, 1}); !st.ok()) return st;
    if (d.state.streams(s)) {
      if (absl::Status st = d.window.WriteBack(s.id); !st.ok()) return st;
    }
  }
  if (absl::StatusOr<absl::Duration> w = d.window.WaitWrites(0); !w.ok()) return w.status();
  g.initialized = true;
  return d.state.WriteMeta(false);
}

absl::Status OffloadedAdam::GetParams(size_t group, std::span<float> out) {
  return GetState(group, Part::kParams, out);
}

absl::Status OffloadedAdam::GetState(size_t group, Part part, std::span<float> out) {
  Impl& d = *impl_;
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  if (part != Part::kParams && part != Part::kM && part != Part::kV) {
    return absl::InvalidArgumentError("GetState: part is not params, m or v");
  }
  if (d.in_step) return absl::FailedPreconditionError("GetState during a step");
  const Group& g = d.state.groups[group];
  if (part == Part::kParams && g.master_in_out()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group '", g.spec.name, "' keeps its master weights in its out, not in the state"));
  }
  if (out.size() != g.spec.params) {
    return absl::InvalidArgumentError(absl::StrCat("group '", g.spec.name, "' has ", g.spec.params,
                                                   " parameters, not ", out.size()));
  }
  if (!g.initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.spec.name, "' has no weights yet: call SetParams"));
  }
  // Within the budget: each shard read is dropped from the host again (unless read ahead).
  for (const Shard& s : g.shards) {
    // Read ahead, or kept on the host: no room to make, nothing to send down.
    const bool read_ahead = d.window.Holds(s.id) || !d.state.streams(s);
    if (!read_ahead) {
      if (absl::StatusOr<absl::Duration> w = d.window.MakeRoom(); !w.ok()) return w.status();
    }
    absl::StatusOr<void*> data = d.state.Pin(s.id, AccessMode::kRead);
    if (!data.ok()) return data.status();
    const char* at = static_cast<const char*>(*data) + s.offset(part);
    if (part != Part::kParams && d.state.options.state_type == ScalarType::kBFloat16) {
      const uint16_t* in = reinterpret_cast<const uint16_t*>(at);
      for (uint64_t i = 0; i < s.n; ++i) out[s.first + i] = kernels::FromBF16(in[i]);
    } else {
      std::memcpy(out.data() + s.first, at, s.n * 4);
    }
    if (absl::Status st = d.client->Release({&s.id, 1}); !st.ok()) return st;
    if (!read_ahead) {
      if (absl::Status st = d.window.WriteBack(s.id); !st.ok()) return st;
    }
  }
  if (absl::StatusOr<absl::Duration> w = d.window.WaitWrites(0); !w.ok()) return w.status();
  return absl::OkStatus();
}

absl::Status OffloadedAdam::BeginStep(float grad_scale) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("BeginStep: a step is already running");
  if (!(grad_scale > 0) || grad_scale == INFINITY) {
    return absl::InvalidArgumentError(absl::StrCat("grad_scale ", grad_scale, " is not > 0"));
  }
  d.step_options.clear();
  for (const AdamHyperparameters& h : d.hyper)
    d.step_options.push_back(KernelOptions(h, grad_scale));
  if (absl::Status s = d.state.WriteMeta(true); !s.ok()) return s;
  d.in_step = true;
  d.step_start = absl::Now();
  d.given.assign(d.state.groups.size(), false);
  d.step_flags.assign(d.state.groups.size(), {});
  for (Group& g : d.state.groups) {
    for (Shard& s : g.shards) s.written = false;
  }
  d.step_order.clear();
  for (internal::StepWorker* lane : d.lanes()) lane->Begin();
  return absl::OkStatus();
}

absl::Status OffloadedAdam::StepGroup(size_t group, const void* grad, ScalarType grad_type,
                                      void* out, ScalarType out_type) {
  return StepGroup(
      group, GroupStep{.grad = grad, .grad_type = grad_type, .out = out, .out_type = out_type});
}

absl::Status OffloadedAdam::StepGroup(size_t group, const GroupStep& step) {
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("StepGroup outside BeginStep/FinishStep");
  if (group >= d.state.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.state.groups.size()));
  }
  const Group& g = d.state.groups[group];
  if (!ValidScalarType(step.grad_type) || !ValidScalarType(step.out_type)) {
    return absl::InvalidArgumentError("StepGroup: unknown scalar type");
  }
  const size_t tensors = g.spec.tensors.size();
  if (!step.tensors.empty() && step.tensors.size() != tensors) {
    return absl::InvalidArgumentError(absl::StrCat("StepGroup: group '", g.spec.name, "' has ",
                                                   tensors, " tensors, not ", step.tensors.size(),
                                                   " flags"));
  }
  std::vector<uint8_t> flags(tensors, kTensorStep);
  if (!step.tensors.empty()) flags.assign(step.tensors.begin(), step.tensors.end());
  bool steps_any = false, takes_any = false;
  for (size_t t = 0; t < tensors; ++t) {
    if (flags[t] & ~(kTensorStep | kTensorTakeWeights)) {
      return absl::InvalidArgumentError(
          absl::StrCat("StepGroup: tensor ", t, " has unknown flags ", flags[t]));
    }
    steps_any |= (flags[t] & kTensorStep) != 0 && g.spec.tensors[t] > 0;
    takes_any |= (flags[t] & kTensorTakeWeights) != 0 && g.spec.tensors[t] > 0;
  }
  if (steps_any && step.grad == nullptr) {
    return absl::InvalidArgumentError("StepGroup: no gradients");
  }
  if (takes_any && step.weights == nullptr) {
    return absl::InvalidArgumentError("StepGroup: weights to take, but no weights");
  }
  if (g.master_in_out() && (steps_any || takes_any) &&
      (step.out == nullptr || step.out_type != ScalarType::kFloat32)) {
    return absl::InvalidArgumentError(
        absl::StrCat("StepGroup: group '", g.spec.name,
                     "' keeps its master weights in its out, which must be fp32 weights"));
  }
  if (!g.initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.spec.name, "' has no weights yet: call SetParams"));
  }
  if (d.given[group]) {
    return absl::FailedPreconditionError(
        absl::StrCat("group '", g.spec.name, "' was already given this step"));
  }
  d.given[group] = true;
  d.step_order.push_back(group);
  d.step_flags[group] = std::move(flags);
  std::vector<uint8_t> touched(g.shards.size(), 0);
  for (size_t k = 0; k < g.shards.size(); ++k) {
    touched[k] = PiecesOf(g, g.shards[k], d.step_flags[group]).empty() ? 0 : 1;
  }
  internal::Work work{
      .group = group, .step = step, .options = d.step_options[group], .number = d.state.steps + 1};
  work.step.tensors = d.step_flags[group];
  d.lane(group).Enqueue(std::move(work), std::move(touched));
  return absl::OkStatus();
}

absl::Status OffloadedAdam::WaitGroup(size_t group, absl::Duration timeout) {
  // The lane's own state, under its lock: what was queued this step and what it is done with.
  // A group's place changes between steps only, while no other thread waits.
  Impl& d = *impl_;
  if (group >= d.state.groups.size()) return d.worker->WaitFor(group, timeout);
  return d.lane(group).WaitFor(group, timeout);
}

absl::Status OffloadedAdam::AbandonStep() {
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("AbandonStep without BeginStep");
  if (!d.state.options.speculative) {
    return absl::FailedPreconditionError(
        "AbandonStep: the optimizer is not speculative, so its steps update the state in place");
  }
  absl::StatusOr<absl::Duration> settled = d.Settle();
  d.in_step = false;
  for (internal::StepWorker* lane : d.lanes()) lane->End();
  // Nothing the step wrote is the state; the meta chunk says no step is running.
  if (absl::Status s = d.state.WriteMeta(false); !s.ok()) return s;
  if (!settled.ok()) return settled.status();
  return d.worker->ReadAhead(std::string::npos, 0, 0);
}

absl::StatusOr<OptimizerStepStats> OffloadedAdam::FinishStep() {
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("FinishStep without BeginStep");
  absl::StatusOr<absl::Duration> settled = d.Settle();
  absl::Status error;
  OptimizerStepStats stats = d.worker->Collect(&error);
  if (d.device_lane != nullptr) {
    absl::Status device_error;
    internal::AddStepStats(d.device_lane->Collect(&device_error), &stats);
    if (error.ok()) error = device_error;
  }
  d.in_step = false;
  if (!error.ok()) return error;
  d.Measure(stats);
  if (!settled.ok()) return settled.status();
  stats.write_wait += *settled;
  for (size_t g = 0; g < d.state.groups.size(); ++g) {
    if (!d.given[g] || std::find(stats.skipped_groups.begin(), stats.skipped_groups.end(), g) !=
                           stats.skipped_groups.end()) {
      continue;
    }
    Group& group = d.state.groups[g];
    for (size_t t = 0; t < group.tensor_steps.size(); ++t) {
      if (d.step_flags[g][t] & kTensorStep) ++group.tensor_steps[t];
    }
    if (!d.state.options.speculative) continue;
    for (Shard& s : group.shards) {  // the versions written become the state
      if (!s.written) continue;
      s.version ^= 1;
      std::swap(s.id, s.other);
    }
  }
  ++d.state.steps;
  if (absl::Status s = d.state.WriteMeta(false); !s.ok()) return s;
  // The next step is expected in this one's order; its first shards come up while the caller
  // runs forward and backward.
  if (d.step_order.size() == d.state.groups.size()) d.worker->expected_order = d.step_order;
  for (internal::StepWorker* lane : d.lanes()) lane->End();
  if (absl::Status s = d.worker->ReadAhead(std::string::npos, 0, 0); !s.ok()) return s;
  stats.step = d.state.steps;
  stats.wall = absl::Now() - d.step_start;
  return stats;
}

}  // namespace tierd
