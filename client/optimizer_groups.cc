// OffloadedAdam's groups: where each is stepped, its hyperparameters and step counts, groups added
// and removed between steps, and a group's weights and state read and written between steps.

#include "absl/container/flat_hash_set.h"
#include "client/optimizer_impl.h"

namespace tierd {

using internal::Group;
using internal::Shard;
using internal::ValidateHyperparameters;

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
    if (absl::Status s = d.SendHomeFromDevice(g); !s.ok()) return s;
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

}  // namespace tierd
