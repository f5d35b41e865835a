// The C ABI of the out-of-core optimizer (tierd::OffloadedAdam).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/adam_hyper.h"
#include "client/c_api_common.h"
#include "tierd/client.h"
#include "tierd/optimizer.hpp"

using tierd::c_abi::Done;
using tierd::c_abi::Fail;
using tierd::c_abi::Guard;
using tierd::c_abi::Invalid;
using tierd::c_abi::KernelType;
using tierd::c_abi::ValidDType;

struct tierd_adam {
  std::unique_ptr<tierd::OffloadedAdam> adam;
  tierd_adam_lanes lanes{.share = -1};  // the last step's
};

namespace {

int64_t Nanos(absl::Duration d) { return absl::ToInt64Nanoseconds(d); }

}  // namespace

extern "C" {

void tierd_adam_options_init(tierd_adam_options* options) {
  if (options == nullptr) return;
  const tierd::OffloadedAdamOptions d;
  *options = tierd_adam_options{.socket_dir = nullptr,
                                .name = "adam",
                                .home_tier = static_cast<int32_t>(d.home),
                                .persistent = d.persistent ? 1 : 0,
                                .reset = d.reset ? 1 : 0,
                                .threads = d.threads,
                                .check_finite = d.check_finite ? 1 : 0,
                                .host_budget_bytes = d.host_budget_bytes,
                                .shard_params = d.shard_params,
                                .hyper = tierd::ToC(d.hyper),
                                .open_mode = static_cast<int32_t>(d.open),
                                .state_dtype = static_cast<int32_t>(d.state_type),
                                .speculative = d.speculative ? 1 : 0,
                                .device_budget_bytes = d.device_budget_bytes};
}

}  // extern "C"

namespace {

// The optimizer's options from the C struct, or an error naming the field.
absl::StatusOr<tierd::OffloadedAdamOptions> AdamOptionsFrom(const tierd_adam_options* options,
                                                            const char* fn) {
  if (options == nullptr) return absl::InvalidArgumentError(absl::StrCat(fn, ": NULL options"));
  if (options->home_tier != TIERD_TIER_HOST && options->home_tier != TIERD_TIER_NVME) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": home_tier must be TIERD_TIER_HOST or TIERD_TIER_NVME"));
  }
  if (options->open_mode < TIERD_ADAM_CREATE_OR_OPEN || options->open_mode > TIERD_ADAM_OPEN) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": open_mode must be TIERD_ADAM_CREATE_OR_OPEN, _CREATE or _OPEN"));
  }
  if (options->state_dtype != TIERD_FLOAT32 && options->state_dtype != TIERD_BFLOAT16) {
    return absl::InvalidArgumentError(
        absl::StrCat(fn, ": state_dtype must be TIERD_FLOAT32 or TIERD_BFLOAT16"));
  }
  tierd::OffloadedAdamOptions o;
  if (options->socket_dir != nullptr) o.client.socket_dir = options->socket_dir;
  if (options->name != nullptr) o.name = options->name;
  o.home = static_cast<tierd::Tier>(options->home_tier);
  o.persistent = options->persistent != 0;
  o.reset = options->reset != 0;
  o.open = static_cast<tierd::OffloadedAdamOptions::Open>(options->open_mode);
  o.threads = options->threads;
  o.check_finite = options->check_finite != 0;
  o.host_budget_bytes = options->host_budget_bytes;
  o.shard_params = options->shard_params;
  o.state_type = static_cast<tierd::ScalarType>(options->state_dtype);
  o.speculative = options->speculative != 0;
  o.device_budget_bytes = options->device_budget_bytes;
  o.hyper = tierd::FromC(options->hyper);
  return o;
}

// The groups of the C structs, or an error naming the one at fault.
absl::StatusOr<std::vector<tierd::ParamGroup>> GroupsFrom(size_t n, const tierd_adam_group* groups,
                                                          const char* fn) {
  if (n > 0 && groups == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(fn, ": NULL groups"));
  std::vector<tierd::ParamGroup> out;
  for (size_t g = 0; g < n; ++g) {
    if (groups[g].name == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": group ", g, " has no name"));
    }
    if (groups[g].n_tensors > 0 && groups[g].tensor_params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(fn, ": group ", g, "'s tensors are NULL"));
    }
    out.push_back({.name = groups[g].name,
                   .params = groups[g].params,
                   .tensors = std::vector<uint64_t>(groups[g].tensor_params,
                                                    groups[g].tensor_params + groups[g].n_tensors),
                   .master = static_cast<tierd::ParamGroup::Master>(groups[g].master)});
  }
  return out;
}

tierd_status CreateAdam(const std::vector<tierd::ParamGroup>& groups,
                        const tierd::OffloadedAdamOptions& o, tierd_adam** out) {
  absl::StatusOr<std::unique_ptr<tierd::OffloadedAdam>> adam =
      tierd::OffloadedAdam::Create(groups, o);
  if (!adam.ok()) return Fail(adam.status());
  *out = new tierd_adam{std::move(*adam)};
  return TIERD_OK;
}

}  // namespace

extern "C" {

tierd_status tierd_adam_create(size_t n_groups, const char* const* group_names,
                               const uint64_t* group_params, const tierd_adam_options* options,
                               tierd_adam** out) {
  if (out == nullptr) return Invalid("tierd_adam_create: out is NULL");
  *out = nullptr;
  if (n_groups > 0 && (group_names == nullptr || group_params == nullptr)) {
    return Invalid("tierd_adam_create: NULL argument");
  }
  return Guard([&] {
    absl::StatusOr<tierd::OffloadedAdamOptions> o = AdamOptionsFrom(options, "tierd_adam_create");
    if (!o.ok()) return Fail(o.status());
    std::vector<tierd::ParamGroup> groups;
    for (size_t g = 0; g < n_groups; ++g) {
      if (group_names[g] == nullptr) return Invalid("tierd_adam_create: a group name is NULL");
      groups.push_back({group_names[g], group_params[g]});
    }
    return CreateAdam(groups, *o, out);
  });
}

tierd_status tierd_adam_create_groups(size_t n_groups, const tierd_adam_group* groups,
                                      const tierd_adam_options* options, tierd_adam** out) {
  if (out == nullptr) return Invalid("tierd_adam_create_groups: out is NULL");
  *out = nullptr;
  return Guard([&] {
    absl::StatusOr<tierd::OffloadedAdamOptions> o =
        AdamOptionsFrom(options, "tierd_adam_create_groups");
    if (!o.ok()) return Fail(o.status());
    absl::StatusOr<std::vector<tierd::ParamGroup>> g =
        GroupsFrom(n_groups, groups, "tierd_adam_create_groups");
    if (!g.ok()) return Fail(g.status());
    return CreateAdam(*g, *o, out);
  });
}

tierd_status tierd_adam_add_groups(tierd_adam* adam, size_t n_groups,
                                   const tierd_adam_group* groups) {
  if (adam == nullptr) return Invalid("tierd_adam_add_groups: NULL optimizer");
  return Guard([&] {
    absl::StatusOr<std::vector<tierd::ParamGroup>> g =
        GroupsFrom(n_groups, groups, "tierd_adam_add_groups");
    if (!g.ok()) return Fail(g.status());
    return Done(adam->adam->AddGroups(*g));
  });
}

tierd_status tierd_adam_remove_groups(tierd_adam* adam, size_t n, const size_t* groups) {
  if (adam == nullptr || (n > 0 && groups == nullptr)) {
    return Invalid("tierd_adam_remove_groups: NULL argument");
  }
  return Guard([&] { return Done(adam->adam->RemoveGroups({groups, n})); });
}

size_t tierd_adam_group_count(const tierd_adam* adam) {
  return adam == nullptr ? 0 : adam->adam->group_count();
}

tierd_status tierd_adam_get_tensor_steps(tierd_adam* adam, size_t group, int64_t* out, size_t n) {
  if (adam == nullptr || (n > 0 && out == nullptr)) {
    return Invalid("tierd_adam_get_tensor_steps: NULL argument");
  }
  return Guard([&] { return Done(adam->adam->GetTensorSteps(group, {out, n})); });
}

tierd_status tierd_adam_set_tensor_steps(tierd_adam* adam, size_t group, const int64_t* steps,
                                         size_t n) {
  if (adam == nullptr || (n > 0 && steps == nullptr)) {
    return Invalid("tierd_adam_set_tensor_steps: NULL argument");
  }
  return Guard([&] { return Done(adam->adam->SetTensorSteps(group, {steps, n})); });
}

void tierd_adam_destroy(tierd_adam* adam) {
  try {
    delete adam;
  } catch (...) {
  }
}

int tierd_adam_resumed(const tierd_adam* adam) {
  return adam != nullptr && adam->adam->resumed() ? 1 : 0;
}

int64_t tierd_adam_steps_taken(const tierd_adam* adam) {
  return adam == nullptr ? 0 : adam->adam->steps_taken();
}

int tierd_adam_initialized(const tierd_adam* adam, size_t group) {
  return adam != nullptr && adam->adam->initialized(group) ? 1 : 0;
}

uint64_t tierd_adam_state_bytes(const tierd_adam* adam) {
  return adam == nullptr ? 0 : adam->adam->state_bytes();
}

tierd_status tierd_adam_set_params(tierd_adam* adam, size_t group, const float* values,
                                   uint64_t n) {
  if (adam == nullptr || (values == nullptr && n > 0)) {
    return Invalid("tierd_adam_set_params: NULL argument");
  }
  return Guard([&] { return Done(adam->adam->SetParams(group, {values, n})); });
}

tierd_status tierd_adam_get_params(tierd_adam* adam, size_t group, float* out, uint64_t n) {
  if (adam == nullptr || (out == nullptr && n > 0)) {
    return Invalid("tierd_adam_get_params: NULL argument");
  }
  return Guard([&] { return Done(adam->adam->GetParams(group, {out, n})); });
}

tierd_status tierd_adam_get_state(tierd_adam* adam, size_t group, int part, float* out,
                                  uint64_t n) {
  if (adam == nullptr || (out == nullptr && n > 0)) {
    return Invalid("tierd_adam_get_state: NULL argument");
  }
  if (part != TIERD_ADAM_PARAMS && part != TIERD_ADAM_M && part != TIERD_ADAM_V) {
    return Invalid("tierd_adam_get_state: part must be TIERD_ADAM_PARAMS, _M or _V");
  }
  return Guard([&] {
    return Done(
        adam->adam->GetState(group, static_cast<tierd::OffloadedAdam::Part>(part), {out, n}));
  });
}

tierd_status tierd_adam_set_state(tierd_adam* adam, size_t group, const float* params,
                                  const float* m, const float* v, uint64_t n) {
  if (adam == nullptr) return Invalid("tierd_adam_set_state: NULL optimizer");
  return Guard([&] {
    return Done(adam->adam->SetState(
        group, params == nullptr ? std::span<const float>() : std::span(params, n),
        m == nullptr ? std::span<const float>() : std::span(m, n),
        v == nullptr ? std::span<const float>() : std::span(v, n)));
  });
}

tierd_status tierd_adam_set_steps(tierd_adam* adam, int64_t steps) {
  if (adam == nullptr) return Invalid("tierd_adam_set_steps: NULL optimizer");
  return Guard([&] { return Done(adam->adam->SetStepsTaken(steps)); });
}

tierd_status tierd_adam_set_group_hyper(tierd_adam* adam, size_t group,
                                        const tierd_adam_hyper* hyper) {
  if (adam == nullptr || hyper == nullptr) {
    return Invalid("tierd_adam_set_group_hyper: NULL argument");
  }
  return Guard(
      [&] { return Done(adam->adam->SetGroupHyperparameters(group, tierd::FromC(*hyper))); });
}

tierd_status tierd_adam_set_lr(tierd_adam* adam, double lr) {
  if (adam == nullptr) return Invalid("tierd_adam_set_lr: NULL optimizer");
  if (!(lr >= 0)) return Invalid("tierd_adam_set_lr: lr must be >= 0");
  adam->adam->SetLearningRate(lr);
  return TIERD_OK;
}

tierd_status tierd_adam_begin_step(tierd_adam* adam, float grad_scale) {
  if (adam == nullptr) return Invalid("tierd_adam_begin_step: NULL optimizer");
  return Guard([&] { return Done(adam->adam->BeginStep(grad_scale)); });
}

tierd_status tierd_adam_step_group(tierd_adam* adam, size_t group, const void* grad, int grad_dtype,
                                   void* out, int out_dtype) {
  if (adam == nullptr) return Invalid("tierd_adam_step_group: NULL optimizer");
  if (!ValidDType(grad_dtype) || !ValidDType(out_dtype)) {
    return Invalid("tierd_adam_step_group: grad_dtype and out_dtype must be tierd_dtype values");
  }
  return Guard([&] {
    return Done(adam->adam->StepGroup(group, grad, static_cast<tierd::ScalarType>(grad_dtype), out,
                                      static_cast<tierd::ScalarType>(out_dtype)));
  });
}

tierd_status tierd_adam_step_tensors(tierd_adam* adam, size_t group, const void* grad,
                                     int grad_dtype, void* out, int out_dtype, const uint8_t* flags,
                                     size_t n_flags, const float* weights) {
  if (adam == nullptr) return Invalid("tierd_adam_step_tensors: NULL optimizer");
  if (!ValidDType(grad_dtype) || !ValidDType(out_dtype)) {
    return Invalid("tierd_adam_step_tensors: grad_dtype and out_dtype must be tierd_dtype values");
  }
  if (n_flags > 0 && flags == nullptr) return Invalid("tierd_adam_step_tensors: NULL flags");
  return Guard([&] {
    return Done(adam->adam->StepGroup(
        group, tierd::GroupStep{.grad = grad,
                                .grad_type = static_cast<tierd::ScalarType>(grad_dtype),
                                .out = out,
                                .out_type = static_cast<tierd::ScalarType>(out_dtype),
                                .tensors = {flags, n_flags},
                                .weights = weights}));
  });
}

tierd_status tierd_adam_finish_step(tierd_adam* adam, tierd_adam_step_stats* out) {
  if (adam == nullptr) return Invalid("tierd_adam_finish_step: NULL optimizer");
  return Guard([&] {
    absl::StatusOr<tierd::OptimizerStepStats> s = adam->adam->FinishStep();
    if (!s.ok()) return Fail(s.status());
    if (out != nullptr) {
      *out =
          tierd_adam_step_stats{.step = s->step,
                                .wall_ns = static_cast<uint64_t>(Nanos(s->wall)),
                                .compute_ns = static_cast<uint64_t>(Nanos(s->compute)),
                                .state_wait_ns = static_cast<uint64_t>(Nanos(s->state_wait)),
                                .write_wait_ns = static_cast<uint64_t>(Nanos(s->write_wait)),
                                .state_bytes = s->state_bytes,
                                .skipped_groups = static_cast<uint32_t>(s->skipped_groups.size())};
    }
    adam->lanes = {.host_params = s->host_params,
                   .host_ns = static_cast<uint64_t>(Nanos(s->host_busy)),
                   .device_params = s->device_params,
                   .device_ns = static_cast<uint64_t>(Nanos(s->device_busy)),
                   .share = adam->adam->DeviceShare(),
                   .device_kept_bytes = s->device_kept_bytes};
    return TIERD_OK;
  });
}

tierd_status tierd_adam_wait_group(tierd_adam* adam, size_t group, int64_t timeout_ms) {
  if (adam == nullptr) return Invalid("tierd_adam_wait_group: NULL optimizer");
  if (timeout_ms < 0) return Invalid("tierd_adam_wait_group: a negative timeout");
  return Guard([&] {
    absl::Status s = adam->adam->WaitGroup(group, absl::Milliseconds(timeout_ms));
    return s.ok() ? TIERD_OK : Fail(s);
  });
}

tierd_status tierd_adam_set_group_place(tierd_adam* adam, size_t group, int place) {
  if (adam == nullptr) return Invalid("tierd_adam_set_group_place: NULL optimizer");
  if (place != TIERD_ADAM_ON_HOST && place != TIERD_ADAM_ON_DEVICE) {
    return Invalid("tierd_adam_set_group_place: place is TIERD_ADAM_ON_HOST or _ON_DEVICE");
  }
  return Guard(
      [&] { return Done(adam->adam->SetGroupPlace(group, static_cast<tierd::StepPlace>(place))); });
}

int tierd_adam_group_place(const tierd_adam* adam, size_t group) {
  if (adam == nullptr) return TIERD_ADAM_ON_HOST;
  return static_cast<int>(adam->adam->group_place(group));
}

tierd_status tierd_adam_lanes_get(const tierd_adam* adam, tierd_adam_lanes* out) {
  if (adam == nullptr || out == nullptr) return Invalid("tierd_adam_lanes_get: NULL argument");
  *out = adam->lanes;
  return TIERD_OK;
}

tierd_status tierd_adam_abandon_step(tierd_adam* adam) {
  if (adam == nullptr) return Invalid("tierd_adam_abandon_step: NULL optimizer");
  return Guard([&] {
    absl::Status s = adam->adam->AbandonStep();
    return s.ok() ? TIERD_OK : Fail(s);
  });
}

}  // extern "C"
