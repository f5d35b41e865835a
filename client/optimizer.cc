// OffloadedAdam: the step's coordinator over the state record (optimizer_state.h) and the workers
// (optimizer_worker.h), one per lane (optimizer_lanes.h). It validates each call, carries the step
// protocol (BeginStep, StepGroup, AbandonStep, FinishStep) and applies a step's outcome to the
// record. Its groups, their places and values are in optimizer_groups.cc; what both share is
// optimizer_impl.h.
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

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/adam_hyper.h"
#include "client/optimizer_impl.h"

namespace tierd {

using internal::Group;
using internal::PiecesOf;
using internal::Shard;
using internal::ShardOf;
using internal::StateBytesPerParam;
using internal::ValidateHyperparameters;
using internal::ValidScalarType;

namespace {

// Shards the budget holds when the caller leaves the size to the optimizer: enough that reads and
// write-backs overlap in a deep queue (tierd-bench offload-step: 8 shards in a 286 MiB budget took
// 0.94 s a step, 23 shards 0.74-0.81 s), at most 4 Mi parameters (48 MiB) each.
constexpr uint64_t kAutoShards = 24;
constexpr uint64_t kMaxAutoShardParams = 4ull << 20;
constexpr uint64_t kMinShardParams = 16 * 1024;

// The shard size the optimizer picks for `budget`: a 24th of it, at most 4 Mi parameters, and at
// most the largest size of which a whole number fills the host tier's segments (`segment`, 0 when
// the daemon does not say): a chunk never spans two, so 48 MiB shards leave 16 MiB of each
// 256 MiB segment empty, and a budget that counts those bytes holds fewer shards than it plans.
uint64_t AutoShardParams(uint64_t budget, ScalarType type, uint64_t segment) {
  uint64_t params =
      std::clamp<uint64_t>(budget / kAutoShards / StateBytesPerParam(type) / 1024 * 1024,
                           kMinShardParams, kMaxAutoShardParams);
  if (segment == 0) return params;
  const uint64_t largest = ShardOf(0, kMaxAutoShardParams, type).bytes();
  const uint64_t fits = segment / ((segment + largest - 1) / largest);
  while (params > kMinShardParams && ShardOf(0, params, type).bytes() > fits) params -= 1024;
  return params;
}

}  // namespace
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

  if (options.persistent && options.device_budget_bytes > 0) {
    return absl::InvalidArgumentError(
        "device_budget_bytes keeps scratch state on the device between steps: persistent state "
        "goes home after every step");
  }

  auto impl = std::make_unique<Impl>();
  impl->state.options = options;
  impl->lr = h.lr;
  ClientOptions client_options = options.client;
  if (client_options.client_name.empty()) client_options.client_name = "optimizer " + options.name;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  if (!client.ok()) return client.status();
  impl->client = std::move(*client);
  impl->state.client = impl->client.get();
  absl::StatusOr<NodeInfo> node = impl->client->GetNodeInfo();
  if (!node.ok()) return node.status();
  const TierStatus* host = node->tier(Tier::kHost);
  impl->host_segment_bytes = host != nullptr ? host->segment_bytes : 0;
  impl->host_free_bytes = host != nullptr ? host->free_bytes : 0;
  uint64_t shard_params = options.shard_params;
  if (shard_params == 0) {
    shard_params =
        AutoShardParams(options.host_budget_bytes, options.state_type, impl->host_segment_bytes);
  }
  impl->state.shard_params = shard_params;
  const uint64_t shard_bytes = ShardOf(0, shard_params, options.state_type).bytes();
  if (impl->host_segment_bytes > 0 && shard_bytes > impl->host_segment_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard_params ", shard_params, " makes shards of ", shard_bytes,
                     " bytes, more than the host tier's segments hold (", impl->host_segment_bytes,
                     "): lower shard_params"));
  }
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

  impl->window.Bind(impl->client.get(), options.home == Tier::kNvme);
  if (absl::Status s = impl->state.Open(); !s.ok()) return s;
  impl->worker = std::make_unique<internal::StepWorker>(
      impl->state,
      std::make_unique<internal::HostLane>(impl->state, impl->window, options.threads));
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
