#include "tierd/optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/adam_hyper.h"
#include "client/optimizer_meta.h"
#include "client/read_ahead.h"
#include "kernels/cpu_adam.h"

namespace tierd {
namespace {

constexpr uint64_t kPage = 4096;
// Shards the budget holds when the caller leaves the size to the optimizer: enough that reads and
// write-backs overlap in a deep queue (tierd-bench offload-step: 8 shards in a 286 MiB budget took
// 0.94 s a step, 23 shards 0.74-0.81 s), at most 4 Mi parameters (48 MiB) each.
constexpr uint64_t kAutoShards = 24;
constexpr uint64_t kMaxAutoShardParams = 4ull << 20;
constexpr uint64_t kMinShardParams = 16 * 1024;
constexpr size_t kMaxGroupName = internal::kMaxMetaGroupName;
constexpr size_t kMaxTensorsPerGroup = 1 << 20;

uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// A state chunk: parameters [first, first + n) of its group, laid out as three page-aligned
// regions: p (fp32), m and v (fp32 or bf16).
struct Shard {
  ChunkId id = 0;     // the chunk holding the state
  ChunkId other = 0;  // speculative: the other version's chunk, which a step writes
  uint64_t first = 0;
  uint64_t n = 0;
  uint64_t p_region = 0;   // bytes of p
  uint64_t mv_region = 0;  // bytes of each of m and v
  uint8_t version = 0;     // of the chunk `id` names: 0 "<name>/<group>/<shard>", 1 "...<shard>.1"
  bool written = false;    // this step wrote it (the worker's while a step runs)
  uint64_t bytes() const { return p_region + 2 * mv_region; }
  uint64_t offset(OffloadedAdam::Part part) const {
    return part == OffloadedAdam::Part::kParams ? 0
           : part == OffloadedAdam::Part::kM    ? p_region
                                                : p_region + mv_region;
  }
};

// Bytes of state per parameter: fp32 weights, and m and v of `state_type`.
uint64_t StateBytesPerParam(ScalarType state_type) {
  return state_type == ScalarType::kBFloat16 ? 8 : 12;
}

// The layout of a shard of parameters [first, first + n).
Shard ShardOf(uint64_t first, uint64_t n, ScalarType state_type) {
  const uint64_t moment_bytes = (StateBytesPerParam(state_type) - 4) / 2;
  return {.first = first,
          .n = n,
          .p_region = RoundUp(n * 4, kPage),
          .mv_region = RoundUp(n * moment_bytes, kPage)};
}

struct Group {
  ParamGroup spec;                     // spec.tensors always lists the tensors
  std::vector<uint64_t> tensor_first;  // where each tensor starts in the group
  std::vector<int64_t> tensor_steps;   // steps each tensor has taken (torch's "step")
  std::vector<Shard> shards;
  bool initialized = false;
};

// A tensor's elements within one shard: [begin, end) counted from the shard's first.
struct Piece {
  size_t tensor;
  uint64_t begin;
  uint64_t end;
  uint8_t flags;
};

// The parts of `g`'s tensors in shard `s` that `flags` marks (any bit), in order.
std::vector<Piece> PiecesOf(const Group& g, const Shard& s, std::span<const uint8_t> flags) {
  std::vector<Piece> pieces;
  const uint64_t lo = s.first, hi = s.first + s.n;
  auto it = std::upper_bound(g.tensor_first.begin(), g.tensor_first.end(), lo);
  size_t t =
      it == g.tensor_first.begin() ? 0 : static_cast<size_t>(it - g.tensor_first.begin()) - 1;
  for (; t < g.tensor_first.size() && g.tensor_first[t] < hi; ++t) {
    const uint64_t begin = std::max(lo, g.tensor_first[t]);
    const uint64_t end = std::min(hi, g.tensor_first[t] + g.spec.tensors[t]);
    if (begin < end && flags[t] != 0) pieces.push_back({t, begin - lo, end - lo, flags[t]});
  }
  return pieces;
}

struct Work {
  size_t group;
  GroupStep step;  // step.tensors: one flag per tensor (Impl::step_flags)
};

size_t ElementBytes(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

kernels::DType ToDType(ScalarType t) {
  switch (t) {
    case ScalarType::kFloat32:
      return kernels::DType::kF32;
    case ScalarType::kBFloat16:
      return kernels::DType::kBF16;
    case ScalarType::kFloat16:
      return kernels::DType::kF16;
  }
  return kernels::DType::kF32;
}

bool ValidScalarType(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kBFloat16 || t == ScalarType::kFloat16;
}

absl::Status ValidateGroupName(const std::string& name) {
  if (name.empty() || name.size() >= kMaxGroupName) {
    return absl::InvalidArgumentError(
        absl::StrCat("group name '", name, "' must be 1 to ", kMaxGroupName - 1, " bytes"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "group name '", name, "' has a character outside letters, digits and '._-'"));
    }
  }
  if (name == "." || name == ".." || name == "meta") {
    return absl::InvalidArgumentError(absl::StrCat("group name '", name, "' is reserved"));
  }
  return absl::OkStatus();
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

// A group's name, and its tensors (filled in as one tensor of all its parameters when not given).
absl::Status ValidateGroup(ParamGroup& g) {
  if (absl::Status s = ValidateGroupName(g.name); !s.ok()) return s;
  if (g.tensors.empty()) g.tensors = {g.params};
  uint64_t sum = 0;
  for (uint64_t n : g.tensors) {
    if (n > g.params - sum) break;
    sum += n;
  }
  if (sum != g.params) {
    return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "': its ", g.tensors.size(),
                                                   " tensors' sizes do not add up to its ",
                                                   g.params, " parameters"));
  }
  if (g.tensors.size() > kMaxTensorsPerGroup) {
    return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "' has ", g.tensors.size(),
                                                   " tensors; at most ", kMaxTensorsPerGroup));
  }
  return absl::OkStatus();
}

// Groups to add beside `existing`, their tensors filled in: valid, and named once.
absl::Status ValidateGroups(std::vector<ParamGroup>& specs, const std::vector<Group>& existing) {
  absl::flat_hash_set<std::string> names;
  for (const Group& g : existing) names.insert(g.spec.name);
  for (ParamGroup& g : specs) {
    if (absl::Status s = ValidateGroup(g); !s.ok()) return s;
    if (!names.insert(g.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("group name '", g.name, "' appears twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct OffloadedAdam::Impl {
  ~Impl() {
    {
      absl::MutexLock lock(&mu);
      stopping = true;
    }
    if (worker.joinable()) worker.join();
    (void)window.WaitWrites(0);
    for (const auto& [id, data] : kept) (void)client->Release({&id, 1});
  }

  OffloadedAdamOptions options;
  std::unique_ptr<Client> client;
  std::unique_ptr<kernels::ThreadPool> pool;
  std::vector<Group> groups;
  ChunkId meta = 0;
  uint64_t meta_size = 0;
  uint64_t meta_generation = 0;  // of the meta chunk: even "<name>/meta", odd "<name>/meta.1"
  // Groups the state records that this optimizer has not opened: Create was given fewer groups
  // (a run that adds groups later, as the first run did). Kept in the meta chunk with their
  // chunks, and resumed by an AddGroups of the same name.
  struct Recorded {
    internal::MetaGroupRecord record;
    bool split_known = true;  // false for format 1, which did not record the tensors
  };
  std::vector<Recorded> dormant;
  uint64_t shard_params = 0;
  uint64_t state_bytes = 0;
  bool resumed = false;
  int64_t steps = 0;
  double lr = 0;
  std::vector<AdamHyperparameters> hyper;  // each group's

  // The step in progress (the driving thread's; the worker reads it while the step runs).
  bool in_step = false;
  std::vector<kernels::AdamOptions> step_options;  // each group's, this step
  std::vector<bool> given;
  // Each group's TensorFlags this step (a copy of what StepGroup was given; every tensor stepped
  // when it was given none), which the worker reads through Work::step.
  std::vector<std::vector<uint8_t>> step_flags;
  // The order the groups came in last step (the order the read-ahead expects), and this step's.
  std::vector<size_t> expected_order, step_order;
  absl::Time step_start;

  absl::Mutex mu;
  std::deque<Work> queue ABSL_GUARDED_BY(mu);
  size_t outstanding ABSL_GUARDED_BY(mu) = 0;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  absl::Status error ABSL_GUARDED_BY(mu);
  std::vector<bool> started ABSL_GUARDED_BY(mu);  // groups the worker has taken this step
  // Each group's shards that its last step read or wrote: the read-ahead expects the same of the
  // next step, so that shards of frozen tensors are not brought up for nothing.
  std::vector<std::vector<uint8_t>> touched ABSL_GUARDED_BY(mu);
  OptimizerStepStats stats ABSL_GUARDED_BY(mu);
  // The worker's time on shards this step (waiting for them included), and how many it stepped.
  absl::Duration shard_time ABSL_GUARDED_BY(mu);
  size_t shards_stepped ABSL_GUARDED_BY(mu) = 0;
  std::thread worker;
  // How long the worker took per shard last step: the read-ahead says when each shard is needed
  // by it, so that the daemon serves write-backs (which free the budget) before reads needed
  // later. Zero until a step has been measured: everything is then due at once.
  absl::Duration pace;

  // The host budget's shards read ahead and written back (state at home on NVMe).
  internal::ReadAheadWindow window;
  // Host-home state: each shard pinned by its first step and kept until the optimizer is
  // destroyed, so a step makes no call to the daemon for it (an NVMe home streams its shards
  // through the budget instead: pinned and released each step). The worker's while a step runs.
  absl::flat_hash_map<ChunkId, void*> kept;

  bool nvme_home() const { return options.home == Tier::kNvme; }
  std::string ShardName(const std::string& group, size_t s, uint32_t version) const {
    return absl::StrCat(options.name, "/", group, "/", s, version == 1 ? ".1" : "");
  }
  std::string ShardName(size_t g, size_t s, uint32_t version) const {
    return ShardName(groups[g].spec.name, s, version);
  }

  // The end of a step, finished or abandoned: waits for the worker to take every queued group,
  // drops what was read ahead for groups not given and waits for every write-back. Returns the
  // time the last two took (write wait), or the first error of either.
  absl::StatusOr<absl::Duration> Settle() {
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](Impl* self)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu) { return self->outstanding == 0; },
          this));
    }
    const absl::Time start = absl::Now();
    absl::Status dropped = window.Drop();
    absl::StatusOr<absl::Duration> drained = window.WaitWrites(0);
    if (!dropped.ok()) return dropped;
    if (!drained.ok()) return drained.status();
    return absl::Now() - start;
  }

  // The shards expected to be stepped next, in order: the rest of group `g` from shard `k` (none
  // when g is npos), the groups queued, then the groups not given yet in last step's order.
  std::vector<ChunkId> Expected(size_t g, size_t k, size_t want) {
    std::vector<size_t> order;
    std::vector<ChunkId> ids;
    absl::MutexLock lock(&mu);
    for (const Work& w : queue) order.push_back(w.group);
    for (size_t e : expected_order) {
      if (e != g && !started[e] && std::find(order.begin(), order.end(), e) == order.end()) {
        order.push_back(e);
      }
    }
    auto add = [&](size_t group, size_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (!groups[group].initialized) return;  // nothing to read yet
      for (size_t i = from; i < groups[group].shards.size() && ids.size() < want; ++i) {
        if (touched[group][i]) ids.push_back(groups[group].shards[i].id);
      }
    };
    if (g != std::string::npos) add(g, k);
    for (size_t e : order) add(e, 0);
    return ids;
  }

  // Fills the budget's free room with read-ahead of the shards expected after group `g`'s shard
  // `k`, `in_hand` shards being pinned now.
  absl::Status ReadAhead(size_t g, size_t k, size_t in_hand) {
    return window.Fill(in_hand, pace, [&](size_t want) { return Expected(g, k, want); });
  }

  // Pins one chunk on the host for `mode` and waits until its bytes are there. While it waits,
  // `between` runs every millisecond (the worker keeps its read-ahead going).
  absl::StatusOr<void*> Pin(ChunkId id, AccessMode mode,
                            const std::function<absl::Status()>& between = nullptr) {
    absl::StatusOr<Acquired> a = client->AcquireIds({&id, 1}, Tier::kHost, mode);
    if (!a.ok()) return a.status();
    absl::Status s;
    for (;;) {
      if (between) {
        if (s = between(); !s.ok()) {
          client->Abandon(a->ready);
          break;
        }
      }
      s = client->Wait(a->ready, between ? absl::Milliseconds(1) : absl::InfiniteDuration());
      if (!between || !absl::IsDeadlineExceeded(s)) break;
      // The wait timed out, unless the request itself failed so; waiting again tells which.
      if (!absl::IsUnavailable(client->Poll(a->ready))) {
        s = client->Wait(a->ready);
        break;
      }
    }
    if (!s.ok()) {
      (void)client->Release({&id, 1});
      return s;
    }
    return a->chunks[0].data;
  }

  // A host-home shard's bytes, pinned for writing the first time it is asked for and kept.
  absl::StatusOr<void*> Keep(ChunkId id) {
    if (auto it = kept.find(id); it != kept.end()) return it->second;
    absl::StatusOr<void*> data = Pin(id, AccessMode::kWrite);
    if (data.ok()) kept.emplace(id, *data);
    return data;
  }

  std::string MetaName(uint64_t generation) const {
    return absl::StrCat(options.name, "/meta", generation % 2 == 1 ? ".1" : "");
  }

  // What the meta chunk records of the state as it is now.
  internal::MetaRecord Record(bool step_running) const {
    internal::MetaRecord r{.shard_params = shard_params,
                           .steps = steps,
                           .in_step = !step_running         ? internal::kNoStep
                                      : options.speculative ? internal::kSpeculativeStep
                                                            : internal::kInPlaceStep,
                           .state_type = static_cast<uint32_t>(options.state_type),
                           .generation = meta_generation};
    for (const Group& g : groups) {
      internal::MetaGroupRecord& out = r.groups.emplace_back();
      out.name = g.spec.name;
      out.params = g.spec.params;
      out.initialized = g.initialized;
      out.tensors = g.spec.tensors;
      out.tensor_steps = g.tensor_steps;
      for (const Shard& sh : g.shards) out.shard_versions.push_back(sh.version);
    }
    for (const Recorded& d : dormant) r.groups.push_back(d.record);
    return r;
  }

  // Writes `record` into chunk `id` of `size` bytes, durably at an NVMe home.
  absl::Status WriteMetaTo(ChunkId id, uint64_t size, const internal::MetaRecord& record) {
    absl::StatusOr<void*> data = Pin(id, AccessMode::kOverwrite);
    if (!data.ok()) return data.status();
    internal::EncodeMeta(record, {static_cast<char*>(*data), size});
    if (absl::Status s = client->Release({&id, 1}); !s.ok()) return s;
    if (!nvme_home()) return absl::OkStatus();
    absl::StatusOr<CompletionToken> t = client->EvictIds({&id, 1}, Tier::kNvme, true);
    if (!t.ok()) return t.status();
    return client->Wait(*t);
  }

  // Records the state in the meta chunk. When the record has outgrown the chunk (groups were
  // added), a larger one is written under the other meta name, one generation on, before the old
  // one is freed: a crash in between leaves both, and Open takes the later generation.
  absl::Status WriteMeta(bool step_running) {
    if (!options.persistent) return absl::OkStatus();
    internal::MetaRecord record = Record(step_running);
    const uint64_t bytes = internal::EncodedMetaSize(record);
    if (bytes <= meta_size) return WriteMetaTo(meta, meta_size, record);
    record.generation = meta_generation + 1;
    const uint64_t size = RoundUp(bytes, kPage);
    absl::StatusOr<std::vector<ChunkId>> grown =
        client->AllocateIds(std::vector<ChunkSpec>{{.size = size,
                                                    .home = options.home,
                                                    .name = MetaName(record.generation),
                                                    .persistent = true}});
    if (!grown.ok()) return grown.status();
    if (absl::Status s = WriteMetaTo((*grown)[0], size, record); !s.ok()) {
      (void)client->Free(*grown);
      return s;
    }
    const ChunkId old = meta;
    meta = (*grown)[0];
    meta_size = size;
    meta_generation = record.generation;
    return client->Free({&old, 1});
  }

  void Run() {
    for (;;) {
      Work work;
      {
        absl::MutexLock lock(&mu);
        mu.Await(absl::Condition(
            +[](Impl* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu) {
              return self->stopping || !self->queue.empty();
            },
            this));
        if (queue.empty()) return;
        work = queue.front();
        queue.pop_front();
        started[work.group] = true;
      }
      OptimizerStepStats delta;
      bool skipped = false;
      absl::Status s = StepOne(work, &delta, &skipped);
      absl::MutexLock lock(&mu);
      if (!s.ok() && error.ok()) error = s;
      if (skipped) stats.skipped_groups.push_back(work.group);
      stats.compute += delta.compute;
      stats.state_wait += delta.state_wait;
      stats.write_wait += delta.write_wait;
      stats.state_bytes += delta.state_bytes;
      --outstanding;
    }
  }

  absl::Status StepOne(const Work& w, OptimizerStepStats* delta, bool* skipped) {
    {
      absl::MutexLock lock(&mu);
      if (!error.ok()) return absl::OkStatus();  // the step already failed; leave the rest
    }
    Group& group = groups[w.group];
    const GroupStep& st = w.step;
    const size_t grad_bytes = ElementBytes(st.grad_type), out_bytes = ElementBytes(st.out_type);
    const uint64_t moment_bytes = (StateBytesPerParam(options.state_type) - 4) / 2;
    if (options.check_finite) {
      // The stepped tensors' gradients only: the others' may hold anything.
      std::vector<kernels::AdamTensor> grads;
      for (size_t t = 0; t < group.spec.tensors.size(); ++t) {
        if ((st.tensors[t] & kTensorStep) == 0 || group.spec.tensors[t] == 0) continue;
        grads.push_back(
            {.grad = static_cast<const char*>(st.grad) + group.tensor_first[t] * grad_bytes,
             .grad_type = ToDType(st.grad_type),
             .n = group.spec.tensors[t]});
      }
      const absl::Time t0 = absl::Now();
      const bool finite = kernels::GradientsFinite(grads, *pool);
      delta->compute += absl::Now() - t0;
      if (!finite) {
        *skipped = true;
        for (const Shard& shard : group.shards) {  // not stepped: drop any read ahead
          if (!window.Take(shard.id)) continue;
          if (absl::Status s = window.WriteBack(shard.id); !s.ok()) return s;
        }
        return absl::OkStatus();
      }
    }
    float* out32 = st.out_type == ScalarType::kFloat32 ? static_cast<float*>(st.out) : nullptr;
    // A speculative step reads the state's version and writes the other: two shards in hand.
    const bool speculative = options.speculative;
    const size_t in_hand = speculative ? 2 : 1;
    auto failed = [&](size_t k, const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("optimizer state of group '", group.spec.name,
                                                 "', shard ", k, ": ", s.message()));
    };
    for (size_t k = 0; k < group.shards.size(); ++k) {
      Shard& shard = group.shards[k];
      const std::vector<Piece> pieces = PiecesOf(group, shard, st.tensors);
      if (pieces.empty()) {  // nothing of it changes: not read, not written
        if (window.Take(shard.id)) {
          if (absl::Status s = window.WriteBack(shard.id); !s.ok()) return s;
        }
        continue;
      }
      const absl::Time t0 = absl::Now();
      if (!window.Take(shard.id)) {  // not read ahead (an unexpected order): room for it first
        absl::StatusOr<absl::Duration> waited = window.MakeRoom();
        if (!waited.ok()) return waited.status();
        delta->write_wait += *waited;
      }
      absl::StatusOr<void*> data =
          nvme_home() ? Pin(shard.id, speculative ? AccessMode::kRead : AccessMode::kWrite,
                            [&] { return ReadAhead(w.group, k + 1, in_hand); })
                      : Keep(shard.id);
      if (!data.ok()) return failed(k, data.status());
      char* base = static_cast<char*>(*data);
      void* to_data = nullptr;  // speculative: the other version, a copy of this one stepped
      absl::Duration room_wait;
      if (speculative) {
        absl::StatusOr<absl::Duration> waited = window.MakeRoom(in_hand);
        absl::StatusOr<void*> to =
            waited.ok()
                ? (nvme_home() ? Pin(shard.other, AccessMode::kOverwrite) : Keep(shard.other))
                : waited.status();
        if (!to.ok()) {
          if (nvme_home()) (void)client->Release({&shard.id, 1});
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
      float* p = reinterpret_cast<float*>(base);
      std::vector<kernels::AdamTensor> stepped;
      for (const Piece& piece : pieces) {
        const uint64_t at = shard.first + piece.begin, n = piece.end - piece.begin;
        if (piece.flags & kTensorTakeWeights) {
          std::memcpy(p + piece.begin, st.weights + at, n * 4);
        }
        if ((piece.flags & kTensorStep) == 0) continue;
        stepped.push_back(
            {.param = p + piece.begin,
             .m = base + shard.offset(Part::kM) + piece.begin * moment_bytes,
             .v = base + shard.offset(Part::kV) + piece.begin * moment_bytes,
             .grad = static_cast<const char*>(st.grad) + at * grad_bytes,
             .grad_type = ToDType(st.grad_type),
             .out = st.out == nullptr || out32 != nullptr
                        ? nullptr
                        : static_cast<char*>(st.out) + at * out_bytes,
             .out_type = ToDType(st.out_type),
             .n = n,
             .state_type = ToDType(options.state_type),
             // Rounds bf16 state differently in every shard and tensor, the same way on every
             // resumption.
             .seed = (static_cast<uint32_t>(w.group << 16) ^ static_cast<uint32_t>(k)) +
                     0x9e3779b9u * static_cast<uint32_t>(piece.tensor),
             .step = group.tensor_steps[piece.tensor] + 1});
      }
      if (!stepped.empty()) kernels::AdamStep(stepped, step_options[w.group], steps + 1, *pool);
      if (out32 != nullptr) {
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
      if (nvme_home()) {  // down to NVMe; the version a speculative step read is clean: dropped
        if (absl::Status s = client->Release({&shard.id, 1}); !s.ok()) return s;
        if (absl::Status s = window.WriteBack(shard.id); !s.ok()) return s;
        if (speculative) {
          if (absl::Status s = client->Release({&shard.other, 1}); !s.ok()) return s;
          if (absl::Status s = window.WriteBack(shard.other); !s.ok()) return s;
        }
      }
      absl::MutexLock lock(&mu);
      shard_time += absl::Now() - t0;
      ++shards_stepped;
    }
    return absl::OkStatus();
  }

  // Lays out group g's shards (their chunks not yet allocated) and its tensors' offsets.
  void LayOut(Group& group) {
    group.tensor_first.clear();
    uint64_t first = 0;
    for (uint64_t n : group.spec.tensors) {
      group.tensor_first.push_back(first);
      first += n;
    }
    group.tensor_steps.resize(group.spec.tensors.size(), 0);
    group.shards.clear();
    for (uint64_t at = 0; at < group.spec.params; at += shard_params) {
      group.shards.push_back(
          ShardOf(at, std::min(shard_params, group.spec.params - at), options.state_type));
    }
  }

  // The chunks of `group`'s shards, in `chunk_specs`: for each shard the other version first
  // (speculative), then the state's. Resuming, the state's must exist.
  void SpecifyChunks(size_t g, bool resuming, std::vector<ChunkSpec>* chunk_specs) const {
    const Group& group = groups[g];
    for (size_t k = 0; k < group.shards.size(); ++k) {
      const Shard& s = group.shards[k];
      ChunkSpec spec{.size = s.bytes(), .home = options.home};
      if (options.persistent) {
        spec.name = ShardName(g, k, s.version);
        spec.persistent = true;
        spec.open_existing = resuming;
        spec.must_exist = resuming;  // never a fresh zeroed one
      }
      spec.tags = {"optimizer"};
      if (options.speculative) {  // the other version: whatever it holds is overwritten
        ChunkSpec other = spec;
        if (options.persistent) {
          other.name = ShardName(g, k, s.version ^ 1);
          other.open_existing = true;
          other.must_exist = false;
        }
        chunk_specs->push_back(std::move(other));
      }
      chunk_specs->push_back(std::move(spec));
    }
  }

  // Takes the chunk ids SpecifyChunks asked for, from `*next` on.
  void AssignChunks(Group& group, const std::vector<ChunkId>& ids, size_t* next) const {
    for (Shard& s : group.shards) {
      if (options.speculative) s.other = ids[(*next)++];
      s.id = ids[(*next)++];
    }
  }

  // The budget is counted in shards of the largest size: the one in hand, those read ahead and
  // those being written back share it. Also the bookkeeping sized by the groups.
  void Resize() {
    uint64_t largest = 0;
    state_bytes = 0;
    for (const Group& group : groups) {
      for (const Shard& sh : group.shards) {
        state_bytes += sh.bytes();
        largest = std::max(largest, sh.bytes());
      }
    }
    if (largest == 0) largest = ShardOf(0, shard_params, options.state_type).bytes();
    window.set_slots(std::max<uint64_t>(1, options.host_budget_bytes / largest));
    absl::MutexLock lock(&mu);
    started.assign(groups.size(), false);
    touched.resize(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) touched[g].resize(groups[g].shards.size(), 1);
  }

  absl::Status Open();
  absl::Status MatchState(const internal::MetaRecord& found, const std::string& what) const;
  absl::Status Adopt(Group& group, const Recorded& recorded, const std::string& what) const;
  absl::Status Lost(const absl::Status& s) const;
  // The states in `all` that are other shares of this state's job (NAME or NAME.rank<r>of<n> for
  // this state's NAME): where a job's state was made, for one that moved between nodes or changed
  // its number of ranks. Empty, or " (this daemon holds ...)".
  std::string OtherShares(const std::vector<ChunkInfo>& all) const;
};

OffloadedAdam::OffloadedAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadedAdam::~OffloadedAdam() = default;

// State at home in memory that the daemon lost in a crash: what the caller can do about it.
absl::Status OffloadedAdam::Impl::Lost(const absl::Status& s) const {
  if (!absl::IsDataLoss(s)) return s;
  return absl::DataLossError(absl::StrCat("optimizer state '", options.name, "': ", s.message(),
                                          " (reset starts afresh; a checkpoint resumes)"));
}

namespace {

// NAME for a sharded state's NAME.rank<r>of<n>; the name itself otherwise.
absl::string_view JobName(absl::string_view state) {
  const size_t dot = state.rfind(".rank");
  if (dot == absl::string_view::npos) return state;
  const absl::string_view suffix = state.substr(dot + 5);
  const size_t of = suffix.find("of");
  const auto digits = [](absl::string_view d) {
    return !d.empty() && std::all_of(d.begin(), d.end(), absl::ascii_isdigit);
  };
  if (of == absl::string_view::npos || !digits(suffix.substr(0, of)) ||
      !digits(suffix.substr(of + 2))) {
    return state;
  }
  return state.substr(0, dot);
}

}  // namespace

std::string OffloadedAdam::Impl::OtherShares(const std::vector<ChunkInfo>& all) const {
  const absl::string_view job = JobName(options.name);
  std::set<std::string> shares;
  for (const ChunkInfo& c : all) {
    if (!c.persistent) continue;
    absl::string_view name = c.name;
    if (!absl::ConsumeSuffix(&name, "/meta") && !absl::ConsumeSuffix(&name, "/meta.1")) continue;
    if (name != options.name && JobName(name) == job) shares.insert(absl::StrCat("'", name, "'"));
  }
  if (shares.empty()) return "";
  return absl::StrCat(" (this daemon holds ", absl::StrJoin(shares, ", "),
                      ": the same job's state, made by ranks that ran here)");
}

// Opens (resumes) or creates the state of `groups`, whose specs are validated.
absl::Status OffloadedAdam::Impl::Open() {
  const std::string prefix = options.name + "/";
  const std::string what = absl::StrCat("optimizer state '", options.name, "'");

  // Persistent state of this name: resume it (or discard it when asked to). The meta chunk is
  // under one of two names (it is replaced by a larger one under the other when groups are added);
  // a crash while it was replaced leaves both, and the later generation is the state's.
  std::vector<ChunkInfo> prefixed;
  std::optional<internal::MetaRecord> found;
  if (options.persistent) {
    absl::StatusOr<std::vector<ChunkInfo>> all = client->ListChunks();
    if (!all.ok()) return all.status();
    std::vector<const ChunkInfo*> metas;
    for (const ChunkInfo& c : *all) {
      if (!c.persistent || !absl::StartsWith(c.name, prefix)) continue;
      prefixed.push_back(c);
    }
    for (const ChunkInfo& c : prefixed) {
      if (c.name == MetaName(0) || c.name == MetaName(1)) metas.push_back(&c);
    }
    if (options.open == OffloadedAdamOptions::Open::kOpen && metas.empty()) {
      return absl::NotFoundError(
          absl::StrCat(what, " does not exist: nothing to resume", OtherShares(*all)));
    }
    if (options.open == OffloadedAdamOptions::Open::kCreate && !metas.empty() && !options.reset) {
      return absl::AlreadyExistsError(
          absl::StrCat(what, " exists already: open it to resume, or reset it to start afresh"));
    }
    if (!options.reset) {
      absl::Status first_error;
      for (const ChunkInfo* c : metas) {
        absl::StatusOr<std::vector<ChunkId>> opened =
            client->AllocateIds(std::vector<ChunkSpec>{{.size = c->size,
                                                        .home = options.home,
                                                        .name = c->name,
                                                        .persistent = true,
                                                        .open_existing = true,
                                                        .must_exist = true}});
        if (!opened.ok()) return Lost(opened.status());
        const ChunkId id = (*opened)[0];
        absl::StatusOr<void*> data = Pin(id, AccessMode::kRead);
        if (!data.ok()) return data.status();
        absl::StatusOr<internal::MetaRecord> record =
            internal::DecodeMeta({static_cast<const char*>(*data), c->size});
        (void)client->Release({&id, 1});
        if (!record.ok()) {
          if (first_error.ok()) first_error = record.status();
          continue;
        }
        if (!found.has_value() || record->generation > found->generation) {
          found = std::move(*record);
          meta = id;
          meta_size = c->size;
          meta_generation = found->generation;
        }
      }
      if (!found.has_value() && !first_error.ok()) {
        return absl::DataLossError(
            absl::StrCat(what, ": ", first_error.message(), " (set reset to start afresh)"));
      }
    }
  }

  std::vector<Recorded> recorded;
  if (found.has_value()) {
    if (absl::Status s = MatchState(*found, what); !s.ok()) return s;
    // A speculative step wrote only the versions that were not yet the state: stopped during
    // one, the state is that of the step before.
    if (found->in_step == internal::kInPlaceStep) {
      return absl::DataLossError(absl::StrCat(
          what, ": step ", found->steps + 1,
          " did not finish (the process or daemon stopped during it), so the state is partly "
          "updated; resume from a checkpoint, or set reset to start afresh"));
    }
    shard_params = found->shard_params;
    steps = found->steps;
    resumed = true;
    for (internal::MetaGroupRecord& r : found->groups) {
      recorded.push_back({std::move(r), found->tensors_known()});
      if (found->tensors_known()) continue;
      // Format 1: one tensor at the steps taken, one version for every shard.
      internal::MetaGroupRecord& old = recorded.back().record;
      old.tensors = {old.params};
      old.tensor_steps = {found->steps};
      old.shard_versions.resize((old.params + shard_params - 1) / shard_params,
                                old.shard_versions.empty() ? 0 : old.shard_versions[0]);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    LayOut(groups[g]);
    if (!found.has_value()) continue;
    auto r = std::find_if(recorded.begin(), recorded.end(),
                          [&](const Recorded& x) { return x.record.name == groups[g].spec.name; });
    if (r == recorded.end()) {
      std::vector<std::string> names;
      for (const Recorded& x : recorded) names.push_back(x.record.name);
      return absl::FailedPreconditionError(absl::StrCat(what, " has no group '",
                                                        groups[g].spec.name, "': its groups are ",
                                                        absl::StrJoin(names, ", ")));
    }
    if (absl::Status s = Adopt(groups[g], *r, what); !s.ok()) return s;
    recorded.erase(r);
  }
  dormant = std::move(recorded);

  // Chunks under the name that are not the state: all of them on reset, or when no meta chunk
  // was written (a Create that stopped before it); else those of groups that are gone (a stop
  // while groups were added or removed) and a meta chunk that was replaced.
  std::vector<ChunkId> stale;
  absl::flat_hash_set<std::string> wanted;
  if (found.has_value()) {
    wanted.insert(MetaName(meta_generation));
    for (const Group& g : groups) {
      for (size_t k = 0; k < g.shards.size(); ++k) {
        wanted.insert(ShardName(g.spec.name, k, 0));
        wanted.insert(ShardName(g.spec.name, k, 1));
      }
    }
    for (const Recorded& d : dormant) {
      for (size_t k = 0; k < d.record.shard_versions.size(); ++k) {
        wanted.insert(ShardName(d.record.name, k, 0));
        wanted.insert(ShardName(d.record.name, k, 1));
      }
    }
  }
  for (const ChunkInfo& c : prefixed) {
    if (!wanted.contains(c.name) && c.id != meta) stale.push_back(c.id);
  }
  if (!stale.empty()) {
    if (absl::Status s = client->Free(stale); !s.ok()) return s;
  }

  // Allocate (or open) the shards' chunks, and the meta chunk of new persistent state.
  std::vector<ChunkSpec> chunk_specs;
  for (size_t g = 0; g < groups.size(); ++g) SpecifyChunks(g, resumed, &chunk_specs);
  if (options.persistent && meta == 0) {
    meta_size = RoundUp(internal::EncodedMetaSize(Record(false)), kPage);
    chunk_specs.push_back(
        {.size = meta_size, .home = options.home, .name = MetaName(0), .persistent = true});
  }
  absl::StatusOr<std::vector<ChunkId>> ids = client->AllocateIds(chunk_specs);
  if (!ids.ok()) return Lost(ids.status());
  size_t i = 0;
  for (Group& group : groups) AssignChunks(group, *ids, &i);
  Resize();
  if (options.persistent && !resumed) {
    meta = (*ids)[i];
    if (absl::Status s = WriteMeta(false); !s.ok()) return s;
  }
  expected_order.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) expected_order[g] = g;
  // Resuming: the first step's state comes up while the caller computes its gradients.
  if (resumed && std::all_of(groups.begin(), groups.end(),
                             [](const Group& group) { return group.initialized; })) {
    return ReadAhead(std::string::npos, 0, 0);
  }
  return absl::OkStatus();
}

// Whether recorded state can be this optimizer's: the same type of moments and shard size.
absl::Status OffloadedAdam::Impl::MatchState(const internal::MetaRecord& found,
                                             const std::string& what) const {
  if (found.state_type != static_cast<uint32_t>(options.state_type)) {
    auto type_name = [](uint32_t t) {
      return t == static_cast<uint32_t>(ScalarType::kFloat32)    ? "float32"
             : t == static_cast<uint32_t>(ScalarType::kBFloat16) ? "bfloat16"
                                                                 : "an unknown type";
    };
    return absl::FailedPreconditionError(
        absl::StrCat(what, " keeps m and v in ", type_name(found.state_type), ", not in ",
                     type_name(static_cast<uint32_t>(options.state_type)),
                     ": open it with the state type it was created with"));
  }
  if (options.shard_params != 0 && options.shard_params != found.shard_params) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " has ", found.shard_params, " parameters per shard, not ", options.shard_params));
  }
  return absl::OkStatus();
}

// Takes a recorded group's state for `group` (laid out), when the record is of its size and
// tensors.
absl::Status OffloadedAdam::Impl::Adopt(Group& group, const Recorded& recorded,
                                        const std::string& what) const {
  const internal::MetaGroupRecord& r = recorded.record;
  if (r.params != group.spec.params || (recorded.split_known && r.tensors != group.spec.tensors)) {
    auto tensors = [](size_t n) { return absl::StrCat(n, n == 1 ? " tensor" : " tensors"); };
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": group '", group.spec.name, "' of ", r.params, " parameters in ",
                     tensors(r.tensors.size()), ", not of ", group.spec.params, " in ",
                     tensors(group.spec.tensors.size())));
  }
  if (r.shard_versions.size() != group.shards.size()) {
    return absl::DataLossError(absl::StrCat(what, ": group '", group.spec.name, "' records ",
                                            r.shard_versions.size(), " shards, not ",
                                            group.shards.size(), " (set reset to start afresh)"));
  }
  group.initialized = r.initialized;
  if (recorded.split_known) {
    group.tensor_steps = r.tensor_steps;
  } else {
    group.tensor_steps.assign(group.spec.tensors.size(), r.tensor_steps[0]);
  }
  for (size_t k = 0; k < group.shards.size(); ++k) group.shards[k].version = r.shard_versions[k];
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OffloadedAdam>> OffloadedAdam::Create(
    std::span<const ParamGroup> specs, const OffloadedAdamOptions& options) {
  if (specs.empty()) return absl::InvalidArgumentError("an optimizer needs at least one group");
  std::vector<ParamGroup> groups(specs.begin(), specs.end());
  if (absl::Status s = ValidateGroups(groups, {}); !s.ok()) return s;
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
  impl->options = options;
  impl->lr = h.lr;
  uint64_t shard_params = options.shard_params;
  if (shard_params == 0) {
    shard_params = std::clamp<uint64_t>(options.host_budget_bytes / kAutoShards /
                                            StateBytesPerParam(options.state_type) / 1024 * 1024,
                                        kMinShardParams, kMaxAutoShardParams);
  }
  impl->shard_params = shard_params;
  const uint64_t shard_bytes = ShardOf(0, shard_params, options.state_type).bytes();
  // The shards in hand (two for a speculative step), one read ahead and one written back.
  const uint64_t min_shards = options.speculative ? 4 : 3;
  if (options.home == Tier::kNvme && options.host_budget_bytes < min_shards * shard_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_budget_bytes ", options.host_budget_bytes, " holds fewer than ", min_shards,
        " shards of ", shard_params, " parameters (", shard_bytes,
        " bytes each): raise it to at least ", min_shards * shard_bytes, " or lower shard_params"));
  }
  for (ParamGroup& g : groups) impl->groups.push_back({.spec = std::move(g)});
  impl->hyper.assign(impl->groups.size(), h);

  ClientOptions client_options = options.client;
  if (client_options.client_name.empty()) client_options.client_name = "optimizer " + options.name;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  if (!client.ok()) return client.status();
  impl->client = std::move(*client);
  impl->window.Bind(impl->client.get(), options.home == Tier::kNvme);
  if (absl::Status s = impl->Open(); !s.ok()) return s;
  impl->pool = std::make_unique<kernels::ThreadPool>(options.threads);
  Impl* raw = impl.get();
  impl->worker = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<OffloadedAdam>(new OffloadedAdam(std::move(impl)));
}

bool OffloadedAdam::resumed() const { return impl_->resumed; }
int64_t OffloadedAdam::steps_taken() const { return impl_->steps; }
size_t OffloadedAdam::group_count() const { return impl_->groups.size(); }
uint64_t OffloadedAdam::shard_params() const { return impl_->shard_params; }
uint64_t OffloadedAdam::state_bytes() const { return impl_->state_bytes; }
bool OffloadedAdam::initialized(size_t group) const {
  return group < impl_->groups.size() && impl_->groups[group].initialized;
}
Client& OffloadedAdam::client() { return *impl_->client; }
void OffloadedAdam::SetLearningRate(double lr) {
  impl_->lr = lr;
  for (AdamHyperparameters& h : impl_->hyper) h.lr = lr;
}
double OffloadedAdam::learning_rate() const { return impl_->lr; }

absl::Status OffloadedAdam::SetGroupHyperparameters(size_t group,
                                                    const AdamHyperparameters& hyper) {
  if (group >= impl_->groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", impl_->groups.size()));
  }
  if (absl::Status s = ValidateHyperparameters(hyper); !s.ok()) return s;
  impl_->hyper[group] = hyper;
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetStepsTaken(int64_t steps) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("SetStepsTaken during a step");
  if (steps < 0) return absl::InvalidArgumentError(absl::StrCat("steps ", steps, " < 0"));
  d.steps = steps;
  for (Group& g : d.groups) g.tensor_steps.assign(g.tensor_steps.size(), steps);
  return d.WriteMeta(false);
}

absl::Status OffloadedAdam::GetTensorSteps(size_t group, std::span<int64_t> out) const {
  const Impl& d = *impl_;
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  const Group& g = d.groups[group];
  if (out.size() != g.tensor_steps.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", g.spec.name, "' has ", g.tensor_steps.size(), " tensors, not ", out.size()));
  }
  std::copy(g.tensor_steps.begin(), g.tensor_steps.end(), out.begin());
  return absl::OkStatus();
}

absl::Status OffloadedAdam::SetTensorSteps(size_t group, std::span<const int64_t> steps) {
  Impl& d = *impl_;
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  if (d.in_step) return absl::FailedPreconditionError("SetTensorSteps during a step");
  Group& g = d.groups[group];
  if (steps.size() != g.tensor_steps.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group '", g.spec.name, "' has ", g.tensor_steps.size(), " tensors, not ", steps.size()));
  }
  for (int64_t s : steps) {
    if (s < 0) return absl::InvalidArgumentError(absl::StrCat("a tensor's steps ", s, " < 0"));
  }
  g.tensor_steps.assign(steps.begin(), steps.end());
  return d.WriteMeta(false);
}

absl::Status OffloadedAdam::AddGroups(std::span<const ParamGroup> specs) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("AddGroups during a step");
  std::vector<ParamGroup> added(specs.begin(), specs.end());
  if (absl::Status s = ValidateGroups(added, d.groups); !s.ok()) return s;
  const std::string what = absl::StrCat("optimizer state '", d.options.name, "'");
  // A group the state records but Create was not given is resumed, not made afresh.
  std::vector<Group> fresh;
  std::vector<bool> resuming;
  std::vector<size_t> taken;  // indexes in d.dormant
  for (ParamGroup& g : added) {
    fresh.push_back({.spec = std::move(g)});
    d.LayOut(fresh.back());
    auto r = std::find_if(d.dormant.begin(), d.dormant.end(), [&](const Impl::Recorded& x) {
      return x.record.name == fresh.back().spec.name;
    });
    resuming.push_back(r != d.dormant.end());
    if (r == d.dormant.end()) continue;
    if (absl::Status s = d.Adopt(fresh.back(), *r, what); !s.ok()) return s;
    taken.push_back(static_cast<size_t>(r - d.dormant.begin()));
  }
  const size_t first = d.groups.size();
  for (Group& g : fresh) d.groups.push_back(std::move(g));
  std::vector<ChunkSpec> chunk_specs;
  for (size_t g = first; g < d.groups.size(); ++g) {
    d.SpecifyChunks(g, resuming[g - first], &chunk_specs);
  }
  absl::StatusOr<std::vector<ChunkId>> ids = d.client->AllocateIds(chunk_specs);
  if (!ids.ok()) {
    d.groups.resize(first);
    return d.Lost(ids.status());
  }
  size_t i = 0;
  for (size_t g = first; g < d.groups.size(); ++g) {
    d.AssignChunks(d.groups[g], *ids, &i);
    AdamHyperparameters h = d.options.hyper;
    h.lr = d.lr;
    d.hyper.push_back(h);
    d.expected_order.push_back(g);
  }
  std::sort(taken.begin(), taken.end());
  for (auto it = taken.rbegin(); it != taken.rend(); ++it) {
    d.dormant.erase(d.dormant.begin() + static_cast<ptrdiff_t>(*it));
  }
  d.Resize();
  return d.WriteMeta(false);
}

absl::Status OffloadedAdam::RemoveGroups(std::span<const size_t> which) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("RemoveGroups during a step");
  std::vector<bool> removed(d.groups.size(), false);
  for (size_t g : which) {
    if (g >= d.groups.size()) {
      return absl::OutOfRangeError(absl::StrCat("group ", g, " of ", d.groups.size()));
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
  std::vector<size_t> index(d.groups.size(), std::string::npos);
  for (size_t g = 0; g < d.groups.size(); ++g) {
    if (!removed[g]) {
      index[g] = kept_groups.size();
      kept_groups.push_back(std::move(d.groups[g]));
      kept_hyper.push_back(d.hyper[g]);
      continue;
    }
    for (const Shard& s : d.groups[g].shards) {
      for (ChunkId id : {s.id, s.other}) {
        if (id == 0) continue;
        if (auto it = d.kept.find(id); it != d.kept.end()) {
          if (absl::Status st = d.client->Release({&id, 1}); !st.ok()) return st;
          d.kept.erase(it);
        }
        freed.push_back(id);
      }
    }
  }
  d.groups = std::move(kept_groups);
  d.hyper = std::move(kept_hyper);
  std::vector<size_t> order;
  for (size_t g : d.expected_order) {
    if (index[g] != std::string::npos) order.push_back(index[g]);
  }
  d.expected_order = std::move(order);
  {
    absl::MutexLock lock(&d.mu);
    std::vector<std::vector<uint8_t>> touched;
    for (size_t g = 0; g < index.size(); ++g) {
      if (index[g] != std::string::npos) touched.push_back(std::move(d.touched[g]));
    }
    d.touched = std::move(touched);
  }
  d.Resize();
  if (absl::Status s = d.WriteMeta(false); !s.ok()) return s;
  if (freed.empty()) return absl::OkStatus();
  return d.client->Free(freed);
}

absl::Status OffloadedAdam::SetParams(size_t group, std::span<const float> values) {
  return SetState(group, values, {}, {});
}

absl::Status OffloadedAdam::SetState(size_t group, std::span<const float> values,
                                     std::span<const float> m, std::span<const float> v) {
  Impl& d = *impl_;
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  if (d.in_step) return absl::FailedPreconditionError("SetState during a step");
  Group& g = d.groups[group];
  for (size_t n : {values.size(), m.empty() ? g.spec.params : m.size(),
                   v.empty() ? g.spec.params : v.size()}) {
    if (n != g.spec.params) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", g.spec.name, "' has ", g.spec.params, " parameters, not ", n));
    }
  }
  if (absl::Status s = d.window.Drop(); !s.ok()) return s;
  for (const Shard& s : g.shards) {
    if (absl::StatusOr<absl::Duration> w = d.window.MakeRoom(); !w.ok()) return w.status();
    absl::StatusOr<void*> data = d.Pin(s.id, AccessMode::kOverwrite);
    if (!data.ok()) return data.status();
    // Each of p, m and v: the shard's values (m and v zero unless given), the page's tail zero.
    // bf16 moments are rounded to nearest.
    char* const base = static_cast<char*>(*data);
    std::memset(base, 0, s.bytes());
    std::memcpy(base, values.data() + s.first, s.n * 4);
    for (auto [part, values_of] : {std::pair{Part::kM, m}, std::pair{Part::kV, v}}) {
      if (values_of.empty()) continue;
      char* at = base + s.offset(part);
      if (d.options.state_type == ScalarType::kBFloat16) {
        uint16_t* out = reinterpret_cast<uint16_t*>(at);
        for (uint64_t i = 0; i < s.n; ++i) out[i] = kernels::ToBF16(values_of[s.first + i]);
      } else {
        std::memcpy(at, values_of.data() + s.first, s.n * 4);
      }
    }
    if (absl::Status st = d.client->Release({&s.id, 1}); !st.ok()) return st;
    if (absl::Status st = d.window.WriteBack(s.id); !st.ok()) return st;
  }
  if (absl::StatusOr<absl::Duration> w = d.window.WaitWrites(0); !w.ok()) return w.status();
  g.initialized = true;
  return d.WriteMeta(false);
}

absl::Status OffloadedAdam::GetParams(size_t group, std::span<float> out) {
  return GetState(group, Part::kParams, out);
}

absl::Status OffloadedAdam::GetState(size_t group, Part part, std::span<float> out) {
  Impl& d = *impl_;
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  if (part != Part::kParams && part != Part::kM && part != Part::kV) {
    return absl::InvalidArgumentError("GetState: part is not params, m or v");
  }
  if (d.in_step) return absl::FailedPreconditionError("GetState during a step");
  const Group& g = d.groups[group];
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
    const bool read_ahead = d.window.Holds(s.id);
    if (!read_ahead) {
      if (absl::StatusOr<absl::Duration> w = d.window.MakeRoom(); !w.ok()) return w.status();
    }
    absl::StatusOr<void*> data = d.Pin(s.id, AccessMode::kRead);
    if (!data.ok()) return data.status();
    const char* at = static_cast<const char*>(*data) + s.offset(part);
    if (part != Part::kParams && d.options.state_type == ScalarType::kBFloat16) {
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
  if (absl::Status s = d.WriteMeta(true); !s.ok()) return s;
  d.in_step = true;
  d.step_start = absl::Now();
  d.given.assign(d.groups.size(), false);
  d.step_flags.assign(d.groups.size(), {});
  for (Group& g : d.groups) {
    for (Shard& s : g.shards) s.written = false;
  }
  d.step_order.clear();
  absl::MutexLock lock(&d.mu);
  d.started.assign(d.groups.size(), false);
  d.error = absl::OkStatus();
  d.stats = OptimizerStepStats{};
  d.shard_time = absl::ZeroDuration();
  d.shards_stepped = 0;
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
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  const Group& g = d.groups[group];
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
  GroupStep work = step;
  work.tensors = d.step_flags[group];
  absl::MutexLock lock(&d.mu);
  d.touched[group] = std::move(touched);
  d.queue.push_back({group, work});
  ++d.outstanding;
  return absl::OkStatus();
}

absl::Status OffloadedAdam::AbandonStep() {
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("AbandonStep without BeginStep");
  if (!d.options.speculative) {
    return absl::FailedPreconditionError(
        "AbandonStep: the optimizer is not speculative, so its steps update the state in place");
  }
  absl::StatusOr<absl::Duration> settled = d.Settle();
  d.in_step = false;
  {
    absl::MutexLock lock(&d.mu);
    d.started.assign(d.groups.size(), false);
  }
  // Nothing the step wrote is the state; the meta chunk says no step is running.
  if (absl::Status s = d.WriteMeta(false); !s.ok()) return s;
  if (!settled.ok()) return settled.status();
  return d.ReadAhead(std::string::npos, 0, 0);
}

absl::StatusOr<OptimizerStepStats> OffloadedAdam::FinishStep() {
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("FinishStep without BeginStep");
  absl::StatusOr<absl::Duration> settled = d.Settle();
  OptimizerStepStats stats;
  absl::Status error;
  {
    absl::MutexLock lock(&d.mu);
    stats = d.stats;
    error = d.error;
    if (d.shards_stepped > 0) d.pace = d.shard_time / d.shards_stepped;
  }
  d.in_step = false;
  if (!error.ok()) return error;
  if (!settled.ok()) return settled.status();
  stats.write_wait += *settled;
  for (size_t g = 0; g < d.groups.size(); ++g) {
    if (!d.given[g] || std::find(stats.skipped_groups.begin(), stats.skipped_groups.end(), g) !=
                           stats.skipped_groups.end()) {
      continue;
    }
    Group& group = d.groups[g];
    for (size_t t = 0; t < group.tensor_steps.size(); ++t) {
      if (d.step_flags[g][t] & kTensorStep) ++group.tensor_steps[t];
    }
    if (!d.options.speculative) continue;
    for (Shard& s : group.shards) {  // the versions written become the state
      if (!s.written) continue;
      s.version ^= 1;
      std::swap(s.id, s.other);
    }
  }
  ++d.steps;
  if (absl::Status s = d.WriteMeta(false); !s.ok()) return s;
  // The next step is expected in this one's order; its first shards come up while the caller
  // runs forward and backward.
  if (d.step_order.size() == d.groups.size()) d.expected_order = d.step_order;
  {
    absl::MutexLock lock(&d.mu);
    d.started.assign(d.groups.size(), false);
  }
  if (absl::Status s = d.ReadAhead(std::string::npos, 0, 0); !s.ok()) return s;
  stats.step = d.steps;
  stats.wall = absl::Now() - d.step_start;
  return stats;
}

}  // namespace tierd
