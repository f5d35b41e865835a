// OffloadedAdam's insides, as its rooms share them: optimizer.cc (Create and the step protocol)
// and optimizer_groups.cc (the groups: their places, hyperparameters, step counts, additions and
// removals, and their weights and state read and written between steps). Internal to the client
// library.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/adam_hyper.h"
#include "client/optimizer_lanes.h"
#include "client/optimizer_state.h"
#include "client/optimizer_worker.h"
#include "client/read_ahead.h"
#include "tierd/optimizer.hpp"

namespace tierd {
namespace internal {

inline bool ValidScalarType(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kBFloat16 || t == ScalarType::kFloat16;
}

inline absl::Status ValidateHyperparameters(const AdamHyperparameters& h) {
  if (!(h.lr >= 0) || !(h.beta1 >= 0 && h.beta1 < 1) || !(h.beta2 >= 0 && h.beta2 < 1) ||
      !(h.eps >= 0) || !(h.weight_decay >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Adam hyperparameters out of range: lr ", h.lr, " (>= 0), betas ", h.beta1, ", ", h.beta2,
        " (in [0, 1)), eps ", h.eps, " (>= 0), weight_decay ", h.weight_decay, " (>= 0)"));
  }
  return absl::OkStatus();
}

// The most shards the read-ahead window of scratch state takes from a budget that holds more
// (Impl::PlanResidency).
constexpr uint64_t kMaxWindowShards = 8;

}  // namespace internal

struct OffloadedAdam::Impl {
  ~Impl() {
    // The threads stop before the window and the record they use.
    device_lane.reset();
    worker.reset();
    (void)window.WaitWrites(0);
  }

  // The budget is counted in shards of the largest size, as many as the host tier's segments hold:
  // the one in hand, those read ahead and those being written back share it. Also the worker's
  // bookkeeping sized by the groups.
  void Resize() {
    uint64_t largest = 0;
    state.state_bytes = 0;
    for (const internal::Group& group : state.groups) {
      for (const internal::Shard& sh : group.shards) {
        state.state_bytes += sh.bytes();
        largest = std::max(largest, sh.bytes());
      }
    }
    if (largest == 0)
      largest = internal::ShardOf(0, state.shard_params, state.options.state_type).bytes();
    const uint64_t slots = std::max<uint64_t>(
        1, internal::HostSlots(state.options.host_budget_bytes, host_segment_bytes, largest));
    window.set_slots(PlanResidency(slots, largest));
    PlanDeviceStay();
    worker->Resize();
    if (device_lane != nullptr) device_lane->Resize();
  }

  // Scratch state at home on NVMe leaves what the budget holds beyond a window for the rest in
  // the host tier from one step to the next, rather than writing it down and reading it up
  // again each step: the shards stepped last (the host lane's, from the end of the expected
  // order), so that the step's tail after backward waits for none of them. They are pinned
  // during their step only: between steps the daemon keeps them as it keeps any chunk, and
  // writes one down only when another needs its room. Persistent state streams whole: what
  // FinishStep acknowledged is on NVMe. The room is bytes: many groups' small last shards stay
  // as far as their bytes fit, not as many as the slots of the largest. Returns the slots (of
  // `largest` bytes) left to the window.
  uint64_t PlanResidency(uint64_t slots, uint64_t largest) {
    const uint64_t per_shard = state.options.speculative ? 2 : 1;
    const bool keeps = state.nvme_home() && !state.options.persistent;
    // A budget that is all the room the tier had, filled to its last slot, leaves the tier no
    // room to turn a chunk around in: with all 48 slots planned in a 2 GiB tier, the read-ahead
    // waited for room and the step read 1.5 times what it wrote; with one left free it read what
    // its plan says. A budget the tier has room beside (a streamed model's optimizer, given half
    // of it) keeps its whole window: with one shard less of it, the optimizer's waits at B were
    // 2.1-2.4 s a step against 1.1-1.3 s (two runs each).
    const bool fills_tier =
        internal::HostSlots(host_free_bytes, host_segment_bytes, largest) <= slots;
    if (keeps && fills_tier && slots > per_shard + 3) --slots;
    // The window the streamed shards need: the shards in hand, one read ahead and one written
    // back at the least; a quarter of the budget when that is more, but no more than
    // kMaxWindowShards. Depth is counted in shards: the read-ahead needs a few of them in flight
    // (with 24 in the budget, a window of 3 doubled the optimizer's waits, 6 did not), while
    // every shard of the window is read and written once more a step than the tier needs. A
    // quarter of a large budget is hundreds of shards (50 GiB of a 200 GiB budget), all moved
    // for nothing.
    const uint64_t window = std::max<uint64_t>(
        per_shard + 2, std::min<uint64_t>(slots / 4, internal::kMaxWindowShards));
    const uint64_t room = keeps && slots > window ? (slots - window) / per_shard * largest : 0;
    const std::vector<size_t> order = ExpectedOrder();
    uint64_t resident = 0;  // bytes
    for (auto g = order.rbegin(); g != order.rend(); ++g) {
      internal::Group& group = state.groups[*g];
      for (auto sh = group.shards.rbegin(); sh != group.shards.rend(); ++sh) {
        sh->resident = !group.on_device && resident + sh->bytes() <= room;
        resident += sh->resident ? sh->bytes() : 0;
      }
    }
    return slots - (resident + largest - 1) / largest * per_shard;
  }

  // Scratch state on the device lane keeps what device_budget_bytes holds in the device tier from
  // one step to the next: the shards stepped last (from the end of the expected order), so that
  // the step's tail after backward moves none of them over the link.
  void PlanDeviceStay() {
    const uint64_t per_shard = state.options.speculative ? 2 : 1;
    uint64_t kept = 0;  // bytes
    const std::vector<size_t> order = ExpectedOrder();
    for (auto g = order.rbegin(); g != order.rend(); ++g) {
      internal::Group& group = state.groups[*g];
      for (auto sh = group.shards.rbegin(); sh != group.shards.rend(); ++sh) {
        const uint64_t bytes = per_shard * sh->bytes();
        sh->stays_on_device = group.on_device && !state.options.persistent &&
                              kept + bytes <= state.options.device_budget_bytes;
        kept += sh->stays_on_device ? bytes : 0;
      }
    }
  }

  // Sends home the shards of `group` that stay in the device tier (the group leaves the device
  // lane): now, rather than when the device tier needs their room.
  absl::Status SendHomeFromDevice(const internal::Group& group) {
    std::vector<ChunkId> ids;
    for (const internal::Shard& sh : group.shards) {
      if (!sh.stays_on_device) continue;
      for (ChunkId id : {sh.id, sh.other}) {
        if (id != 0) ids.push_back(id);
      }
    }
    if (ids.empty()) return absl::OkStatus();
    absl::StatusOr<CompletionToken> t = client->EvictIds(ids, state.options.home);
    if (!t.ok()) return t.status();
    return client->Wait(*t);
  }

  // The order the groups are stepped in: the expected one, then any it does not name yet.
  std::vector<size_t> ExpectedOrder() const {
    std::vector<size_t> order;
    std::vector<bool> listed(state.groups.size(), false);
    for (size_t g : worker->expected_order) {
      if (g < listed.size() && !listed[g]) order.push_back(g), listed[g] = true;
    }
    for (size_t g = 0; g < listed.size(); ++g) {
      if (!listed[g]) order.push_back(g);
    }
    return order;
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
    device_lane = std::make_unique<internal::StepWorker>(
        state, std::make_unique<internal::DeviceLane>(state, std::move(kernels)));
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
  uint64_t host_segment_bytes = 0;         // the host tier's segments (0: the daemon did not say)
  uint64_t host_free_bytes = 0;            // the host tier's free room when the optimizer was made

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

}  // namespace tierd
