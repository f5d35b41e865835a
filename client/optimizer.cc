#include "tierd/optimizer.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
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
constexpr uint64_t kMetaMagic = 0x316d616472656974ull;  // "tierdam1"
constexpr uint32_t kMetaVersion = 1;
constexpr size_t kMaxGroupName = 64;

// The meta chunk: what the state is (to refuse opening it with other groups) and whether its last
// step finished. Written durably at each step's start and end.
struct MetaHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t groups;
  uint64_t shard_params;
  int64_t steps;
  uint32_t in_step;     // 0, or the step running: kInPlace or kSpeculative
  uint32_t state_type;  // ScalarType of m and v (0, fp32, in state written before bf16 state)
};
struct MetaGroup {
  uint64_t params;
  uint32_t initialized;
  uint32_t version;  // which of the group's two versions is its state (0 in state of one version)
  char name[kMaxGroupName];
};
// MetaHeader::in_step: a step that rewrites the state in place (interrupted, the state is partly
// updated), or one that writes the other version only (interrupted, the state is as it was).
constexpr uint32_t kInPlace = 1;
constexpr uint32_t kSpeculative = 2;

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
  ParamGroup spec;
  std::vector<Shard> shards;
  bool initialized = false;
  uint32_t version = 0;  // of the chunks `id` names: 0 "<name>/<group>/<shard>", 1 "...<shard>.1"
};

struct Work {
  size_t group;
  const void* grad;
  ScalarType grad_type;
  void* out;
  ScalarType out_type;
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

}  // namespace

struct OffloadedAdam::Impl {
  ~Impl() {
    {
      absl::MutexLock lock(&mu);
      stopping = true;
    }
    if (worker.joinable()) worker.join();
    (void)WaitWrites(0);
    for (const auto& [id, data] : kept) (void)client->Release({&id, 1});
  }

  OffloadedAdamOptions options;
  std::unique_ptr<Client> client;
  std::unique_ptr<kernels::ThreadPool> pool;
  std::vector<Group> groups;
  ChunkId meta = 0;
  uint64_t meta_size = 0;
  uint64_t shard_params = 0;
  uint64_t state_bytes = 0;
  size_t slots = 0;  // shards the host budget holds: in hand, read ahead and being written back
  bool resumed = false;
  int64_t steps = 0;
  double lr = 0;
  std::vector<AdamHyperparameters> hyper;  // each group's

  // The step in progress (the driving thread's; the worker reads it while the step runs).
  bool in_step = false;
  std::vector<kernels::AdamOptions> step_options;  // each group's, this step
  std::vector<bool> given;
  // The order the groups came in last step (the order the read-ahead expects), and this step's.
  std::vector<size_t> expected_order, step_order;
  absl::Time step_start;

  absl::Mutex mu;
  std::deque<Work> queue ABSL_GUARDED_BY(mu);
  size_t outstanding ABSL_GUARDED_BY(mu) = 0;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  absl::Status error ABSL_GUARDED_BY(mu);
  std::vector<bool> started ABSL_GUARDED_BY(mu);  // groups the worker has taken this step
  OptimizerStepStats stats ABSL_GUARDED_BY(mu);
  // The worker's time on shards this step (waiting for them included), and how many it stepped.
  absl::Duration shard_time ABSL_GUARDED_BY(mu);
  size_t shards_stepped ABSL_GUARDED_BY(mu) = 0;
  std::thread worker;
  // How long the worker took per shard last step: the read-ahead says when each shard is needed
  // by it, so that the daemon serves write-backs (which free the budget) before reads needed
  // later. Zero until a step has been measured: everything is then due at once.
  absl::Duration pace;

  // The window of state on the host besides the shard in hand, each entry one shard's worth of
  // the budget (the worker's while a step runs, else the driver's): shards asked for ahead of
  // their turn, in the order they are expected, and write-backs in flight, oldest first.
  struct Ahead {
    ChunkId id;
    CompletionToken prefetch;
  };
  std::deque<Ahead> ahead;
  std::deque<CompletionToken> writes;
  // Host-home state: each shard pinned by its first step and kept until the optimizer is
  // destroyed, so a step makes no call to the daemon for it (an NVMe home streams its shards
  // through the budget instead: pinned and released each step). The worker's while a step runs.
  absl::flat_hash_map<ChunkId, void*> kept;

  bool nvme_home() const { return options.home == Tier::kNvme; }
  std::string ShardName(size_t g, size_t s, uint32_t version) const {
    return absl::StrCat(options.name, "/", groups[g].spec.name, "/", s, version == 1 ? ".1" : "");
  }

  // Waits until at most `keep` write-backs are in flight. Returns the time waited.
  absl::StatusOr<absl::Duration> WaitWrites(size_t keep) {
    const absl::Time start = absl::Now();
    absl::Status first;
    while (writes.size() > keep) {
      absl::Status s = client->Wait(writes.front());
      if (!s.ok() && first.ok()) first = s;
      writes.pop_front();
    }
    if (!first.ok()) return first;
    return absl::Now() - start;
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
    absl::Status dropped = DropAhead();
    absl::StatusOr<absl::Duration> drained = WaitWrites(0);
    if (!dropped.ok()) return dropped;
    if (!drained.ok()) return drained.status();
    return absl::Now() - start;
  }

  // Collects the write-backs that have finished, without waiting.
  absl::Status ReapWrites() {
    absl::Status first;
    for (auto it = writes.begin(); it != writes.end();) {
      if (absl::IsUnavailable(client->Poll(*it))) {  // pending
        ++it;
        continue;
      }
      absl::Status s = client->Wait(*it);
      if (!s.ok() && first.ok()) first = s;
      it = writes.erase(it);
    }
    return first;
  }

  // Sends a shard's host copy (or the meta chunk's) down to its home tier and drops it there,
  // without waiting: a dirty copy is written, a clean one only dropped.
  absl::Status WriteBack(ChunkId id) {
    if (!nvme_home()) return absl::OkStatus();
    absl::StatusOr<CompletionToken> t = client->EvictIds({&id, 1}, Tier::kNvme);
    if (!t.ok()) return t.status();
    writes.push_back(*t);
    return absl::OkStatus();
  }

  bool IsAhead(ChunkId id) const {
    return std::any_of(ahead.begin(), ahead.end(), [id](const Ahead& a) { return a.id == id; });
  }

  // Takes `id` out of the read-ahead window (it is about to be pinned, or is not wanted). Returns
  // whether it was there.
  bool TakeAhead(ChunkId id) {
    for (auto it = ahead.begin(); it != ahead.end(); ++it) {
      if (it->id != id) continue;
      client->Abandon(it->prefetch);  // its Acquire, or its eviction, reports any failure
      ahead.erase(it);
      return true;
    }
    return false;
  }

  // Empties the read-ahead window, dropping the copies it brought up.
  absl::Status DropAhead() {
    while (!ahead.empty()) {
      const ChunkId id = ahead.back().id;
      TakeAhead(id);
      if (absl::Status s = WriteBack(id); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Makes room in the budget for `in_hand` shards on the host: waits for the oldest write-backs,
  // or gives up the furthest read-ahead when none is in flight. Returns the time waited.
  absl::StatusOr<absl::Duration> MakeRoom(size_t in_hand = 1) {
    if (!nvme_home()) return absl::ZeroDuration();
    if (absl::Status s = ReapWrites(); !s.ok()) return s;
    absl::Duration waited;
    while (ahead.size() + writes.size() + in_hand > slots && !(ahead.empty() && writes.empty())) {
      if (writes.empty()) {
        const ChunkId id = ahead.back().id;
        TakeAhead(id);
        if (absl::Status s = WriteBack(id); !s.ok()) return s;
      }
      absl::StatusOr<absl::Duration> w = WaitWrites(writes.size() - 1);
      if (!w.ok()) return w.status();
      waited += *w;
    }
    return waited;
  }

  // The shards expected to be stepped next, in order: the rest of group `g` from shard `k` (none
  // when g is npos), the groups queued, then the groups not given yet in last step's order.
  std::vector<ChunkId> Expected(size_t g, size_t k, size_t want) {
    std::vector<size_t> order;
    {
      absl::MutexLock lock(&mu);
      for (const Work& w : queue) order.push_back(w.group);
      for (size_t e : expected_order) {
        if (e != g && !started[e] && std::find(order.begin(), order.end(), e) == order.end()) {
          order.push_back(e);
        }
      }
    }
    std::vector<ChunkId> ids;
    auto add = [&](size_t group, size_t from) {
      if (!groups[group].initialized) return;  // nothing to read yet
      for (size_t i = from; i < groups[group].shards.size() && ids.size() < want; ++i) {
        ids.push_back(groups[group].shards[i].id);
      }
    };
    if (g != std::string::npos) add(g, k);
    for (size_t e : order) add(e, 0);
    return ids;
  }

  // The Prefetch priority of the shard expected `j` shards from now: due when the worker will
  // reach it at last step's pace (a priority unit is a millisecond; the daemon caps any wait).
  int Priority(size_t j) const {
    constexpr double kLatest = 1000;
    return -static_cast<int>(std::min(kLatest, absl::ToDoubleMilliseconds(pace * j)));
  }

  // Fills the budget's free room with read-ahead of the shards expected after group `g`'s shard
  // `k`, `in_hand` shards being pinned now.
  absl::Status ReadAhead(size_t g, size_t k, size_t in_hand) {
    if (!nvme_home()) return absl::OkStatus();
    if (absl::Status s = ReapWrites(); !s.ok()) return s;
    const size_t used = ahead.size() + writes.size() + in_hand;
    if (used >= slots) return absl::OkStatus();
    const size_t room = slots - used;
    const std::vector<ChunkId> expected = Expected(g, k, ahead.size() + room);
    for (size_t j = 0; j < expected.size(); ++j) {
      const ChunkId id = expected[j];
      if (ahead.size() + writes.size() + in_hand >= slots) break;
      if (IsAhead(id)) continue;
      absl::StatusOr<CompletionToken> t = client->PrefetchIds({&id, 1}, Tier::kHost, Priority(j));
      if (!t.ok()) return t.status();
      ahead.push_back({id, *t});
    }
    return absl::OkStatus();
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

  absl::Status WriteMeta(bool step_running) {
    if (!options.persistent) return absl::OkStatus();
    absl::StatusOr<void*> data = Pin(meta, AccessMode::kOverwrite);
    if (!data.ok()) return data.status();
    std::memset(*data, 0, meta_size);
    MetaHeader h{.magic = kMetaMagic,
                 .version = kMetaVersion,
                 .groups = static_cast<uint32_t>(groups.size()),
                 .shard_params = shard_params,
                 .steps = steps,
                 .in_step = !step_running         ? 0u
                            : options.speculative ? kSpeculative
                                                  : kInPlace,
                 .state_type = static_cast<uint32_t>(options.state_type)};
    std::memcpy(*data, &h, sizeof(h));
    auto* records = reinterpret_cast<MetaGroup*>(static_cast<char*>(*data) + sizeof(h));
    for (size_t g = 0; g < groups.size(); ++g) {
      records[g].params = groups[g].spec.params;
      records[g].initialized = groups[g].initialized ? 1 : 0;
      records[g].version = groups[g].version;
      std::memcpy(records[g].name, groups[g].spec.name.data(), groups[g].spec.name.size());
    }
    if (absl::Status s = client->Release({&meta, 1}); !s.ok()) return s;
    if (!nvme_home()) return absl::OkStatus();
    absl::StatusOr<CompletionToken> t = client->EvictIds({&meta, 1}, Tier::kNvme, true);
    if (!t.ok()) return t.status();
    return client->Wait(*t);
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
    const size_t grad_bytes = ElementBytes(w.grad_type), out_bytes = ElementBytes(w.out_type);
    if (options.check_finite) {
      const absl::Time t0 = absl::Now();
      const kernels::AdamTensor all{
          .grad = w.grad, .grad_type = ToDType(w.grad_type), .n = group.spec.params};
      const bool finite = kernels::GradientsFinite({&all, 1}, *pool);
      delta->compute += absl::Now() - t0;
      if (!finite) {
        *skipped = true;
        for (const Shard& shard : group.shards) {  // not stepped: drop any read ahead
          if (!TakeAhead(shard.id)) continue;
          if (absl::Status s = WriteBack(shard.id); !s.ok()) return s;
        }
        return absl::OkStatus();
      }
    }
    float* out32 = w.out_type == ScalarType::kFloat32 ? static_cast<float*>(w.out) : nullptr;
    // A speculative step reads the state's version and writes the other: two shards in hand.
    const bool speculative = options.speculative;
    const size_t in_hand = speculative ? 2 : 1;
    auto failed = [&](size_t k, const absl::Status& s) {
      return absl::Status(s.code(), absl::StrCat("optimizer state of group '", group.spec.name,
                                                 "', shard ", k, ": ", s.message()));
    };
    for (size_t k = 0; k < group.shards.size(); ++k) {
      const Shard& shard = group.shards[k];
      const absl::Time t0 = absl::Now();
      if (!TakeAhead(shard.id)) {  // not read ahead (an unexpected order): room for it first
        absl::StatusOr<absl::Duration> waited = MakeRoom();
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
        absl::StatusOr<absl::Duration> waited = MakeRoom(in_hand);
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
      const kernels::AdamTensor t{
          .param = p,
          .m = base + shard.offset(Part::kM),
          .v = base + shard.offset(Part::kV),
          .grad = static_cast<const char*>(w.grad) + shard.first * grad_bytes,
          .grad_type = ToDType(w.grad_type),
          .out = w.out == nullptr || out32 != nullptr
                     ? nullptr
                     : static_cast<char*>(w.out) + shard.first * out_bytes,
          .out_type = ToDType(w.out_type),
          .n = shard.n,
          .state_type = ToDType(options.state_type),
          // Rounds bf16 state differently in every shard, the same way on every resumption.
          .seed = static_cast<uint32_t>(w.group << 16) ^ static_cast<uint32_t>(k)};
      kernels::AdamStep({&t, 1}, step_options[w.group], steps + 1, *pool);
      if (out32 != nullptr) std::memcpy(out32 + shard.first, p, shard.n * 4);
      const absl::Time t2 = absl::Now();
      delta->state_wait += t1 - t0 - room_wait;
      delta->write_wait += room_wait;
      delta->compute += t2 - t1;
      delta->state_bytes += shard.bytes();
      if (nvme_home()) {  // down to NVMe; the version a speculative step read is clean: dropped
        if (absl::Status s = client->Release({&shard.id, 1}); !s.ok()) return s;
        if (absl::Status s = WriteBack(shard.id); !s.ok()) return s;
        if (speculative) {
          if (absl::Status s = client->Release({&shard.other, 1}); !s.ok()) return s;
          if (absl::Status s = WriteBack(shard.other); !s.ok()) return s;
        }
      }
      absl::MutexLock lock(&mu);
      shard_time += absl::Now() - t0;
      ++shards_stepped;
    }
    return absl::OkStatus();
  }

  absl::Status Open(std::span<const ParamGroup> specs);
  absl::Status Lost(const absl::Status& s) const;
};

OffloadedAdam::OffloadedAdam(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OffloadedAdam::~OffloadedAdam() = default;

// State at home in memory that the daemon lost in a crash: what the caller can do about it.
absl::Status OffloadedAdam::Impl::Lost(const absl::Status& s) const {
  if (!absl::IsDataLoss(s)) return s;
  return absl::DataLossError(absl::StrCat("optimizer state '", options.name, "': ", s.message(),
                                          " (reset starts afresh; a checkpoint resumes)"));
}

absl::Status OffloadedAdam::Impl::Open(std::span<const ParamGroup> specs) {
  const std::string prefix = options.name + "/";
  const std::string meta_name = prefix + "meta";
  meta_size = RoundUp(sizeof(MetaHeader) + specs.size() * sizeof(MetaGroup), kPage);

  // Persistent state of this name: resume it (or discard it when asked to).
  std::vector<ChunkId> stale;
  const MetaHeader* found = nullptr;
  std::vector<char> found_bytes;
  if (options.persistent) {
    absl::StatusOr<std::vector<ChunkInfo>> all = client->ListChunks();
    if (!all.ok()) return all.status();
    const ChunkInfo* found_meta = nullptr;
    for (const ChunkInfo& c : *all) {
      if (!c.persistent || !absl::StartsWith(c.name, prefix)) continue;
      if (c.name == meta_name) found_meta = &c;
      stale.push_back(c.id);
    }
    if (options.open == OffloadedAdamOptions::Open::kOpen && found_meta == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("optimizer state '", options.name, "' does not exist: nothing to resume"));
    }
    if (options.open == OffloadedAdamOptions::Open::kCreate && found_meta != nullptr &&
        !options.reset) {
      return absl::AlreadyExistsError(
          absl::StrCat("optimizer state '", options.name,
                       "' exists already: open it to resume, or reset it to start afresh"));
    }
    if (found_meta != nullptr && !options.reset) {
      absl::StatusOr<std::vector<ChunkId>> opened =
          client->AllocateIds(std::vector<ChunkSpec>{{.size = found_meta->size,
                                                      .home = options.home,
                                                      .name = meta_name,
                                                      .persistent = true,
                                                      .open_existing = true,
                                                      .must_exist = true}});
      if (!opened.ok()) return Lost(opened.status());
      meta = (*opened)[0];
      absl::StatusOr<void*> data = Pin(meta, AccessMode::kRead);
      if (!data.ok()) return data.status();
      found_bytes.assign(static_cast<char*>(*data), static_cast<char*>(*data) + found_meta->size);
      (void)client->Release({&meta, 1});
      found = reinterpret_cast<const MetaHeader*>(found_bytes.data());
      stale.clear();
    }
  }

  if (found != nullptr) {
    const std::string what = absl::StrCat("optimizer state '", options.name, "'");
    if (found->magic != kMetaMagic || found->version != kMetaVersion ||
        found_bytes.size() < sizeof(MetaHeader) + found->groups * sizeof(MetaGroup)) {
      return absl::DataLossError(absl::StrCat(what,
                                              ": its meta chunk is not one this library "
                                              "wrote (set reset to start afresh)"));
    }
    if (found->groups != specs.size()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " has ", found->groups, " groups, not ", specs.size()));
    }
    if (found->state_type != static_cast<uint32_t>(options.state_type)) {
      auto type_name = [](uint32_t t) {
        return t == static_cast<uint32_t>(ScalarType::kFloat32)    ? "float32"
               : t == static_cast<uint32_t>(ScalarType::kBFloat16) ? "bfloat16"
                                                                   : "an unknown type";
      };
      return absl::FailedPreconditionError(
          absl::StrCat(what, " keeps m and v in ", type_name(found->state_type), ", not in ",
                       type_name(static_cast<uint32_t>(options.state_type)),
                       ": open it with the state type it was created with"));
    }
    if (options.shard_params != 0 && options.shard_params != found->shard_params) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " has ", found->shard_params, " parameters per shard, not ", options.shard_params));
    }
    const auto* records = reinterpret_cast<const MetaGroup*>(found_bytes.data() + sizeof(*found));
    for (size_t g = 0; g < specs.size(); ++g) {
      const std::string name(records[g].name, strnlen(records[g].name, kMaxGroupName));
      if (name != specs[g].name || records[g].params != specs[g].params) {
        return absl::FailedPreconditionError(
            absl::StrCat(what, ": group ", g, " is '", name, "' of ", records[g].params,
                         " parameters, not '", specs[g].name, "' of ", specs[g].params));
      }
    }
    for (size_t g = 0; g < specs.size(); ++g) {
      if (records[g].version > 1) {
        return absl::DataLossError(absl::StrCat(
            what, ": its meta chunk is not one this library wrote (set reset to start afresh)"));
      }
    }
    // A speculative step wrote only the versions that were not yet the state: stopped during
    // one, the state is that of the step before.
    if (found->in_step != 0 && found->in_step != kSpeculative) {
      return absl::DataLossError(absl::StrCat(
          what, ": step ", found->steps + 1,
          " did not finish (the process or daemon stopped during it), so the state is partly "
          "updated; resume from a checkpoint, or set reset to start afresh"));
    }
    shard_params = found->shard_params;
    steps = found->steps;
    resumed = true;
    for (size_t g = 0; g < specs.size(); ++g) {
      groups[g].initialized = records[g].initialized != 0;
      groups[g].version = records[g].version;
    }
  }
  if (!stale.empty()) {  // reset, or chunks left by a Create that never wrote its meta
    if (absl::Status s = client->Free(stale); !s.ok()) return s;
  }

  // Lay the groups out in shards and allocate (or open) their chunks.
  std::vector<ChunkSpec> chunk_specs;
  for (size_t g = 0; g < groups.size(); ++g) {
    Group& group = groups[g];
    for (uint64_t first = 0; first < group.spec.params; first += shard_params) {
      const Shard s =
          ShardOf(first, std::min(shard_params, group.spec.params - first), options.state_type);
      ChunkSpec spec{.size = s.bytes(), .home = options.home};
      if (options.persistent) {
        spec.name = ShardName(g, group.shards.size(), group.version);
        spec.persistent = true;
        // Resuming, every shard must already be there: never a fresh zeroed one.
        spec.open_existing = resumed;
        spec.must_exist = resumed;
      }
      spec.tags = {"optimizer"};
      if (options.speculative) {  // the other version: whatever it holds is overwritten
        ChunkSpec other = spec;
        if (options.persistent) {
          other.name = ShardName(g, group.shards.size(), group.version ^ 1);
          other.open_existing = true;
          other.must_exist = false;
        }
        chunk_specs.push_back(std::move(other));
      }
      chunk_specs.push_back(std::move(spec));
      group.shards.push_back(s);
      state_bytes += s.bytes();
    }
  }
  if (options.persistent && meta == 0) {
    chunk_specs.push_back(
        {.size = meta_size, .home = options.home, .name = meta_name, .persistent = true});
  }
  absl::StatusOr<std::vector<ChunkId>> ids = client->AllocateIds(chunk_specs);
  if (!ids.ok()) return Lost(ids.status());
  size_t i = 0;
  for (Group& group : groups) {
    for (Shard& s : group.shards) {
      if (options.speculative) s.other = (*ids)[i++];
      s.id = (*ids)[i++];
    }
  }
  if (options.persistent && meta == 0) {
    meta = (*ids)[i];
    if (absl::Status s = WriteMeta(false); !s.ok()) return s;
  }

  // The budget is counted in shards of the largest size: the one in hand, those read ahead and
  // those being written back share it.
  uint64_t largest = 0;
  for (const Group& group : groups) {
    for (const Shard& sh : group.shards) largest = std::max(largest, sh.bytes());
  }
  slots = std::max<uint64_t>(1, options.host_budget_bytes / largest);
  expected_order.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) expected_order[g] = g;
  {
    absl::MutexLock lock(&mu);
    started.assign(groups.size(), false);
  }
  // Resuming: the first step's state comes up while the caller computes its gradients.
  if (resumed && std::all_of(groups.begin(), groups.end(),
                             [](const Group& group) { return group.initialized; })) {
    return ReadAhead(std::string::npos, 0, 0);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OffloadedAdam>> OffloadedAdam::Create(
    std::span<const ParamGroup> specs, const OffloadedAdamOptions& options) {
  if (specs.empty()) return absl::InvalidArgumentError("an optimizer needs at least one group");
  for (size_t g = 0; g < specs.size(); ++g) {
    if (absl::Status s = ValidateGroupName(specs[g].name); !s.ok()) return s;
    if (specs[g].params == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", specs[g].name, "' has no parameters"));
    }
    for (size_t h = 0; h < g; ++h) {
      if (specs[h].name == specs[g].name) {
        return absl::InvalidArgumentError(
            absl::StrCat("group name '", specs[g].name, "' appears twice"));
      }
    }
  }
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
  for (const ParamGroup& g : specs) impl->groups.push_back({.spec = g});
  impl->hyper.assign(specs.size(), h);

  ClientOptions client_options = options.client;
  if (client_options.client_name.empty()) client_options.client_name = "optimizer " + options.name;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(client_options);
  if (!client.ok()) return client.status();
  impl->client = std::move(*client);
  if (absl::Status s = impl->Open(specs); !s.ok()) return s;
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
  return d.WriteMeta(false);
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
  if (absl::Status s = d.DropAhead(); !s.ok()) return s;
  for (const Shard& s : g.shards) {
    if (absl::StatusOr<absl::Duration> w = d.MakeRoom(); !w.ok()) return w.status();
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
    if (absl::Status st = d.WriteBack(s.id); !st.ok()) return st;
  }
  if (absl::StatusOr<absl::Duration> w = d.WaitWrites(0); !w.ok()) return w.status();
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
    const bool read_ahead = d.IsAhead(s.id);
    if (!read_ahead) {
      if (absl::StatusOr<absl::Duration> w = d.MakeRoom(); !w.ok()) return w.status();
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
      if (absl::Status st = d.WriteBack(s.id); !st.ok()) return st;
    }
  }
  if (absl::StatusOr<absl::Duration> w = d.WaitWrites(0); !w.ok()) return w.status();
  return absl::OkStatus();
}

absl::Status OffloadedAdam::BeginStep(float grad_scale) {
  Impl& d = *impl_;
  if (d.in_step) return absl::FailedPreconditionError("BeginStep: a step is already running");
  if (!(grad_scale > 0) || grad_scale == INFINITY) {
    return absl::InvalidArgumentError(absl::StrCat("grad_scale ", grad_scale, " is not > 0"));
  }
  d.step_options.clear();
  for (const AdamHyperparameters& h : d.hyper) {
    d.step_options.push_back({.lr = h.lr,
                              .beta1 = h.beta1,
                              .beta2 = h.beta2,
                              .eps = h.eps,
                              .weight_decay = h.weight_decay,
                              .decoupled = h.adamw,
                              .grad_scale = grad_scale});
  }
  if (absl::Status s = d.WriteMeta(true); !s.ok()) return s;
  d.in_step = true;
  d.step_start = absl::Now();
  d.given.assign(d.groups.size(), false);
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
  Impl& d = *impl_;
  if (!d.in_step) return absl::FailedPreconditionError("StepGroup outside BeginStep/FinishStep");
  if (group >= d.groups.size()) {
    return absl::OutOfRangeError(absl::StrCat("group ", group, " of ", d.groups.size()));
  }
  const Group& g = d.groups[group];
  if (grad == nullptr) return absl::InvalidArgumentError("StepGroup: no gradients");
  if (!ValidScalarType(grad_type) || !ValidScalarType(out_type)) {
    return absl::InvalidArgumentError("StepGroup: unknown scalar type");
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
  absl::MutexLock lock(&d.mu);
  d.queue.push_back({group, grad, grad_type, out, out_type});
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
  if (d.options.speculative) {  // the versions written become the state
    for (size_t g = 0; g < d.groups.size(); ++g) {
      if (!d.given[g] || std::find(stats.skipped_groups.begin(), stats.skipped_groups.end(), g) !=
                             stats.skipped_groups.end()) {
        continue;
      }
      d.groups[g].version ^= 1;
      for (Shard& s : d.groups[g].shards) std::swap(s.id, s.other);
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
