// HostLane (optimizer_lanes.h): a group's shards stepped by the CPU kernels, the read-ahead window
// kept filled with the shards expected next at the pace the lane measured.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/optimizer_lanes.h"

namespace tierd::internal {

HostLane::HostLane(StateRecord& state, ReadAheadWindow& window, int threads)
    : state_(state), window_(window), pool_(std::make_unique<kernels::ThreadPool>(threads)) {}

absl::Status HostLane::ReadAhead(size_t g, size_t k, size_t in_hand,
                                 const ExpectedShards& expected) {
  return window_.Fill(in_hand, pace_, [&](size_t want) { return expected(g, k, want); });
}

absl::Status HostLane::Settle() {
  if (shards_stepped_ > 0) pace_ = shard_time_ / shards_stepped_;
  shard_time_ = absl::ZeroDuration();
  shards_stepped_ = 0;
  absl::Status dropped = window_.Drop();
  absl::StatusOr<absl::Duration> drained = window_.WaitWrites(0);
  if (!dropped.ok()) return dropped;
  return drained.status();
}

absl::Status HostLane::Step(const Work& w, const ExpectedShards& expected,
                            OptimizerStepStats* delta, bool* skipped) {
  Group& group = state_.groups[w.group];
  const GroupStep& st = w.step;
  if (state_.options.check_finite) {
    const absl::Time t0 = absl::Now();
    const bool finite = kernels::GradientsFinite(SteppedGradients(group, st), *pool_);
    delta->compute += absl::Now() - t0;
    if (!finite) {
      *skipped = true;
      for (const Shard& shard : group.shards) {  // not stepped: drop any read ahead
        if (!window_.Take(shard.id)) continue;
        if (absl::Status s = window_.WriteBack(shard.id); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
  }
  float* out32 = st.out_type == ScalarType::kFloat32 ? static_cast<float*>(st.out) : nullptr;
  // A speculative step reads the state's version and writes the other: two shards in hand.
  const bool speculative = state_.options.speculative;
  const size_t in_hand = speculative ? 2 : 1;
  auto failed = [&](size_t k, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("optimizer state of group '", group.spec.name,
                                               "', shard ", k, ": ", s.message()));
  };
  for (size_t k = 0; k < group.shards.size(); ++k) {
    Shard& shard = group.shards[k];
    const std::vector<Piece> pieces = PiecesOf(group, shard, st.tensors);
    if (pieces.empty()) {  // nothing of it changes: not read, not written
      if (window_.Take(shard.id)) {
        if (absl::Status s = window_.WriteBack(shard.id); !s.ok()) return s;
      }
      continue;
    }
    const absl::Time t0 = absl::Now();
    const bool streams = state_.streams(shard);
    if (streams && !window_.Take(shard.id)) {  // not read ahead (an unexpected order): room first
      absl::StatusOr<absl::Duration> waited = window_.MakeRoom();
      if (!waited.ok()) return waited.status();
      delta->write_wait += *waited;
    }
    // At home on NVMe a shard is pinned for its step only (a resident one too: between steps
    // the daemon may need its room); at home on the host it stays pinned.
    const bool pins = state_.nvme_home();
    absl::StatusOr<void*> data =
        pins ? state_.Pin(shard.id, speculative ? AccessMode::kRead : AccessMode::kWrite,
                          [&] { return ReadAhead(w.group, k + 1, in_hand, expected); })
             : state_.Keep(shard.id);
    if (!data.ok()) return failed(k, data.status());
    char* base = static_cast<char*>(*data);
    void* to_data = nullptr;  // speculative: the other version, a copy of this one stepped
    absl::Duration room_wait;
    if (speculative) {
      absl::StatusOr<absl::Duration> waited =
          streams ? window_.MakeRoom(in_hand)
                  : absl::StatusOr<absl::Duration>(absl::ZeroDuration());
      absl::StatusOr<void*> to =
          waited.ok()
              ? (pins ? state_.Pin(shard.other, AccessMode::kOverwrite) : state_.Keep(shard.other))
              : waited.status();
      if (!to.ok()) {
        if (pins) (void)state_.client->Release({&shard.id, 1});
        return failed(k, to.status());
      }
      room_wait = *waited;
      to_data = *to;
    }
    const absl::Time t1 = absl::Now();
    if (to_data != nullptr) {
      std::memcpy(to_data, base, shard.bytes());
      base = static_cast<char*>(to_data);
    }
    float* p = MasterOf(group, shard, base, st);  // in its out: nothing to copy back
    std::vector<kernels::AdamTensor> stepped;
    for (const Piece& piece : pieces) {
      const uint64_t at = shard.first + piece.begin, n = piece.end - piece.begin;
      if (piece.flags & kTensorTakeWeights) {
        std::memcpy(p + piece.begin, st.weights + at, n * 4);
      }
      if ((piece.flags & kTensorStep) == 0) continue;
      stepped.push_back(PieceTensor(group, w.group, k, piece, base, st, state_.options.state_type));
    }
    if (!stepped.empty()) kernels::AdamStep(stepped, w.options, w.number, *pool_);
    if (out32 != nullptr && !group.master_in_out()) {
      for (const Piece& piece : pieces) {
        if ((piece.flags & kTensorStep) == 0) continue;
        std::memcpy(out32 + shard.first + piece.begin, p + piece.begin,
                    (piece.end - piece.begin) * 4);
      }
    }
    shard.written = true;
    const absl::Time t2 = absl::Now();
    delta->state_wait += t1 - t0 - room_wait;
    delta->write_wait += room_wait;
    delta->compute += t2 - t1;
    delta->state_bytes += shard.bytes();
    // A streamed shard goes down to NVMe (the version a speculative step read is clean: only
    // dropped); a resident one stays where it is.
    for (ChunkId id : {shard.id, speculative ? shard.other : ChunkId{0}}) {
      if (id == 0 || !pins) continue;
      if (absl::Status s = state_.client->Release({&id, 1}); !s.ok()) return s;
      if (!streams) continue;
      if (absl::Status s = window_.WriteBack(id); !s.ok()) return s;
    }
    shard_time_ += absl::Now() - t0;
    ++shards_stepped_;
  }
  return absl::OkStatus();
}

}  // namespace tierd::internal
