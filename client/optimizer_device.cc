// DeviceLane (optimizer_lanes.h): a group placed on the device is stepped shard by shard in the
// daemon's device tier. Each shard is acquired there one ahead of its turn (the daemon brings
// it up from its home through the host while the one before is stepped), stepped by the device
// kernels over the device's gradients, released, and sent home with its device copy dropped, so
// that the device tier holds at most two shards of the lane's at a time (four when speculative)
// and the state is at home, as after a host step, once the step settles — but for the shards
// that stay on the device (Shard::stays_on_device, within device_budget_bytes): those are
// released there, and the next step finds them in the device tier.
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/optimizer_lanes.h"

namespace tierd::internal {
namespace {

// One shard's chunks acquired in the device tier: the state's, and for a speculative step the
// other version it writes.
struct OnDevice {
  size_t k = 0;
  std::optional<Acquired> state;
  std::optional<Acquired> other;
};

}  // namespace

DeviceLane::DeviceLane(StateRecord& state, std::unique_ptr<DeviceKernels> device)
    : state_(state), device_(std::move(device)) {}

absl::Status DeviceLane::Settle() {
  absl::Status first;
  for (const CompletionToken& t : homeward_) {
    absl::Status s = state_.client->Wait(t);
    if (first.ok() && !s.ok()) first = s;
  }
  homeward_.clear();
  return first;
}

absl::Status DeviceLane::Step(const Work& w, const ExpectedShards&, OptimizerStepStats* delta,
                              bool* skipped) {
  Group& group = state_.groups[w.group];
  const GroupStep& st = w.step;
  const bool speculative = state_.options.speculative;
  Client& client = *state_.client;
  auto failed = [&](size_t k, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("optimizer state of group '", group.spec.name,
                                               "', shard ", k, " on the device: ", s.message()));
  };
  if (state_.options.check_finite) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<bool> finite = device_->Finite(SteppedGradients(group, st));
    delta->compute += absl::Now() - t0;
    if (!finite.ok()) return finite.status();
    if (!*finite) {
      *skipped = true;
      return absl::OkStatus();
    }
  }

  std::vector<size_t> todo;  // the shards something of which changes
  for (size_t k = 0; k < group.shards.size(); ++k) {
    if (!PiecesOf(group, group.shards[k], st.tensors).empty()) todo.push_back(k);
  }
  // Acquires shard k: the state for writing (speculative: for reading, and the other version to
  // overwrite). The requests complete while the shard before is stepped.
  auto acquire = [&](size_t k, OnDevice* out) -> absl::Status {
    const Shard& shard = group.shards[k];
    out->k = k;
    absl::StatusOr<Acquired> a = client.AcquireIds(
        {&shard.id, 1}, Tier::kDevice, speculative ? AccessMode::kRead : AccessMode::kWrite);
    if (!a.ok()) return a.status();
    out->state = std::move(*a);
    if (!speculative) return absl::OkStatus();
    a = client.AcquireIds({&shard.other, 1}, Tier::kDevice, AccessMode::kOverwrite);
    if (!a.ok()) return a.status();
    out->other = std::move(*a);
    return absl::OkStatus();
  };
  // Lets go of what `on` holds without using it (a failure): abandoned and released.
  auto give_up = [&](OnDevice& on) {
    for (std::optional<Acquired>* a : {&on.state, &on.other}) {
      if (!a->has_value()) continue;
      client.Abandon((*a)->ready);
      (void)client.Release({&(*a)->chunks[0].id, 1});
      a->reset();
    }
  };
  // Releases a stepped shard's chunks and sends them home (the version a speculative step read is
  // clean: its device copy is only dropped), or leaves them in the device tier where it `stays`.
  auto put_away = [&](OnDevice& on, bool stays) -> absl::Status {
    absl::Status first;
    for (std::optional<Acquired>* a : {&on.state, &on.other}) {
      if (!a->has_value()) continue;
      const ChunkId id = (*a)->chunks[0].id;
      a->reset();
      absl::Status s = client.Release({&id, 1});
      if (s.ok() && !stays) {
        absl::StatusOr<CompletionToken> t = client.EvictIds({&id, 1}, state_.options.home);
        if (t.ok()) homeward_.push_back(*t);
        s = t.status();
      }
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  };

  OnDevice next;
  if (!todo.empty()) {
    if (absl::Status s = acquire(todo[0], &next); !s.ok()) {
      give_up(next);
      return failed(todo[0], s);
    }
  }
  for (size_t i = 0; i < todo.size(); ++i) {
    OnDevice on = std::move(next);
    next = OnDevice{};
    const size_t k = on.k;
    Shard& shard = group.shards[k];
    const absl::Time t0 = absl::Now();
    absl::Status s = client.Wait(on.state->ready);
    if (s.ok() && on.other.has_value()) s = client.Wait(on.other->ready);
    if (!s.ok()) {
      give_up(on);
      return failed(k, s);
    }
    if (i + 1 < todo.size()) {
      if (s = acquire(todo[i + 1], &next); !s.ok()) {
        give_up(next);
        give_up(on);
        return failed(todo[i + 1], s);
      }
    }
    const absl::Time t1 = absl::Now();
    char* base = static_cast<char*>(on.state->chunks[0].data);
    if (on.other.has_value()) {
      char* to = static_cast<char*>(on.other->chunks[0].data);
      s = device_->Copy(to, base, shard.bytes());
      base = to;
    }
    float* p = reinterpret_cast<float*>(base);
    float* out32 = st.out_type == ScalarType::kFloat32 ? static_cast<float*>(st.out) : nullptr;
    const std::vector<Piece> pieces = PiecesOf(group, shard, st.tensors);
    std::vector<kernels::AdamTensor> stepped;
    for (const Piece& piece : pieces) {
      const uint64_t at = shard.first + piece.begin, n = piece.end - piece.begin;
      if (s.ok() && (piece.flags & kTensorTakeWeights)) {
        s = device_->Upload(p + piece.begin, st.weights + at, n * 4);
      }
      if ((piece.flags & kTensorStep) == 0) continue;
      stepped.push_back(PieceTensor(group, w.group, k, piece, base, st, ScalarType::kFloat32));
    }
    if (s.ok()) s = device_->Step(stepped, w.options);
    for (const Piece& piece : pieces) {
      if (!s.ok() || out32 == nullptr || (piece.flags & kTensorStep) == 0) continue;
      s = device_->Copy(out32 + shard.first + piece.begin, p + piece.begin,
                        (piece.end - piece.begin) * 4);
    }
    if (!s.ok()) {
      give_up(next);
      // What the device wrote goes home, staying shard or not: the step's error reports it.
      (void)put_away(on, false);
      return failed(k, s);
    }
    shard.written = true;
    const absl::Time t2 = absl::Now();
    delta->state_wait += t1 - t0;
    delta->compute += t2 - t1;
    delta->state_bytes += shard.bytes();
    if (shard.stays_on_device) delta->device_kept_bytes += shard.bytes();
    if (s = put_away(on, shard.stays_on_device); !s.ok()) {
      give_up(next);
      return failed(k, s);
    }
  }
  return absl::OkStatus();
}

}  // namespace tierd::internal
