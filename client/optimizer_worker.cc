#include "client/optimizer_worker.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace tierd::internal {

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

float* MasterOf(const Group& group, const Shard& shard, char* base, const GroupStep& step) {
  return group.master_in_out() ? static_cast<float*>(step.out) + shard.first
                               : reinterpret_cast<float*>(base);
}

kernels::AdamTensor PieceTensor(const Group& group, size_t g, size_t k, const Piece& piece,
                                char* base, const GroupStep& step, ScalarType state_type) {
  const Shard& shard = group.shards[k];
  const uint64_t at = shard.first + piece.begin;
  const uint64_t moment_bytes = (StateBytesPerParam(state_type) - 4) / 2;
  const bool out32 = step.out_type == ScalarType::kFloat32;
  return {.param = MasterOf(group, shard, base, step) + piece.begin,
          .m = base + shard.offset(OffloadedAdam::Part::kM) + piece.begin * moment_bytes,
          .v = base + shard.offset(OffloadedAdam::Part::kV) + piece.begin * moment_bytes,
          .grad = static_cast<const char*>(step.grad) + at * ElementBytes(step.grad_type),
          .grad_type = ToDType(step.grad_type),
          .out = step.out == nullptr || out32
                     ? nullptr
                     : static_cast<char*>(step.out) + at * ElementBytes(step.out_type),
          .out_type = ToDType(step.out_type),
          .n = piece.end - piece.begin,
          .state_type = ToDType(state_type),
          // Rounds bf16 state differently in every shard and tensor, the same way on every
          // resumption.
          .seed = (static_cast<uint32_t>(g << 16) ^ static_cast<uint32_t>(k)) +
                  0x9e3779b9u * static_cast<uint32_t>(piece.tensor),
          .step = group.tensor_steps[piece.tensor] + 1};
}

void AddStepStats(const OptimizerStepStats& from, OptimizerStepStats* into) {
  into->compute += from.compute;
  into->state_wait += from.state_wait;
  into->write_wait += from.write_wait;
  into->state_bytes += from.state_bytes;
  into->skipped_groups.insert(into->skipped_groups.end(), from.skipped_groups.begin(),
                              from.skipped_groups.end());
  into->host_params += from.host_params;
  into->host_busy += from.host_busy;
  into->device_params += from.device_params;
  into->device_busy += from.device_busy;
}

std::vector<kernels::AdamTensor> SteppedGradients(const Group& group, const GroupStep& step) {
  const size_t grad_bytes = ElementBytes(step.grad_type);
  std::vector<kernels::AdamTensor> grads;
  for (size_t t = 0; t < group.spec.tensors.size(); ++t) {
    if ((step.tensors[t] & kTensorStep) == 0 || group.spec.tensors[t] == 0) continue;
    grads.push_back(
        {.grad = static_cast<const char*>(step.grad) + group.tensor_first[t] * grad_bytes,
         .grad_type = ToDType(step.grad_type),
         .n = group.spec.tensors[t]});
  }
  return grads;
}

StepWorker::StepWorker(StateRecord& state, ReadAheadWindow& window, int threads)
    : state_(state), window_(window), pool_(std::make_unique<kernels::ThreadPool>(threads)) {
  thread_ = std::thread([this] { Run(); });
}

StepWorker::StepWorker(StateRecord& state, ReadAheadWindow& window,
                       std::unique_ptr<DeviceKernels> device)
    : state_(state), window_(window), device_(std::move(device)) {
  thread_ = std::thread([this] { Run(); });
}

StepWorker::~StepWorker() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void StepWorker::Begin() {
  absl::MutexLock lock(&mu_);
  started_.assign(state_.groups.size(), false);
  done_.assign(state_.groups.size(), false);
  queued_.assign(state_.groups.size(), false);
  error_ = absl::OkStatus();
  stats_ = OptimizerStepStats{};
  shard_time_ = absl::ZeroDuration();
  shards_stepped_ = 0;
}

void StepWorker::Enqueue(Work work, std::vector<uint8_t> touched) {
  absl::MutexLock lock(&mu_);
  touched_[work.group] = std::move(touched);
  queued_[work.group] = true;
  queue_.push_back(std::move(work));
  ++outstanding_;
}

OptimizerStepStats StepWorker::Collect(absl::Status* error) {
  absl::MutexLock lock(&mu_);
  *error = error_;
  if (shards_stepped_ > 0) pace_ = shard_time_ / shards_stepped_;
  return stats_;
}

void StepWorker::End() {
  absl::MutexLock lock(&mu_);
  started_.assign(state_.groups.size(), false);
  done_.assign(state_.groups.size(), false);
  queued_.assign(state_.groups.size(), false);
}

absl::Status StepWorker::WaitFor(size_t g, absl::Duration timeout) {
  struct Waiting {
    StepWorker* self;
    size_t g;
  } waiting{this, g};
  absl::MutexLock lock(&mu_);
  if (g >= queued_.size() || !queued_[g]) {
    return absl::FailedPreconditionError(absl::StrCat("group ", g, " was not queued this step"));
  }
  const absl::Condition done(
      +[](Waiting* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held: the Condition's contract
        return w->self->stopping_ || (w->g < w->self->done_.size() && w->self->done_[w->g]);
      },
      &waiting);
  if (!mu_.AwaitWithTimeout(done, timeout)) {
    return absl::DeadlineExceededError(
        absl::StrCat("group ", g, " is not done within ", absl::FormatDuration(timeout)));
  }
  if (g < done_.size() && done_[g]) return absl::OkStatus();
  return absl::FailedPreconditionError("the optimizer is closing");
}

absl::Status StepWorker::ReadAhead(size_t g, size_t k, size_t in_hand) {
  if (device_ != nullptr) return absl::OkStatus();  // the device lane reads nothing ahead
  return window_.Fill(in_hand, pace_, [&](size_t want) { return Expected(g, k, want); });
}

void StepWorker::Resize() {
  absl::MutexLock lock(&mu_);
  started_.assign(state_.groups.size(), false);
  done_.assign(state_.groups.size(), false);
  queued_.assign(state_.groups.size(), false);
  touched_.resize(state_.groups.size());
  for (size_t g = 0; g < state_.groups.size(); ++g) {
    touched_[g].resize(state_.groups[g].shards.size(), 1);
  }
}

void StepWorker::Reindex(const std::vector<size_t>& index) {
  std::vector<size_t> order;
  for (size_t g : expected_order) {
    if (index[g] != std::string::npos) order.push_back(index[g]);
  }
  expected_order = std::move(order);
  absl::MutexLock lock(&mu_);
  std::vector<std::vector<uint8_t>> touched;
  for (size_t g = 0; g < index.size(); ++g) {
    if (index[g] != std::string::npos) touched.push_back(std::move(touched_[g]));
  }
  touched_ = std::move(touched);
  done_.assign(touched_.size(), false);
  queued_.assign(touched_.size(), false);
}

absl::StatusOr<absl::Duration> StepWorker::Settle() {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](StepWorker* self)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->outstanding_ == 0; },
        this));
  }
  const absl::Time start = absl::Now();
  if (device_ != nullptr) {
    if (absl::Status s = WaitHomeward(); !s.ok()) return s;
    return absl::Now() - start;
  }
  absl::Status dropped = window_.Drop();
  absl::StatusOr<absl::Duration> drained = window_.WaitWrites(0);
  if (!dropped.ok()) return dropped;
  if (!drained.ok()) return drained.status();
  return absl::Now() - start;
}

std::vector<ChunkId> StepWorker::Expected(size_t g, size_t k, size_t want) {
  std::vector<size_t> order;
  std::vector<ChunkId> ids;
  absl::MutexLock lock(&mu_);
  for (const Work& w : queue_) order.push_back(w.group);
  for (size_t e : expected_order) {
    if (e != g && !started_[e] && std::find(order.begin(), order.end(), e) == order.end()) {
      order.push_back(e);
    }
  }
  auto add = [&](size_t group, size_t from) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Nothing to read yet, or stepped by the device lane.
    if (!state_.groups[group].initialized || state_.groups[group].on_device) return;
    for (size_t i = from; i < state_.groups[group].shards.size() && ids.size() < want; ++i) {
      const Shard& shard = state_.groups[group].shards[i];
      if (touched_[group][i] && state_.streams(shard)) ids.push_back(shard.id);
    }
  };
  if (g != std::string::npos) add(g, k);
  for (size_t e : order) add(e, 0);
  return ids;
}

void StepWorker::Run() {
  for (;;) {
    Work work;
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepWorker* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stopping_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;
      work = queue_.front();
      queue_.pop_front();
      started_[work.group] = true;
      failed = !error_.ok();  // the step already failed: the rest is left as it is
    }
    OptimizerStepStats delta;
    bool skipped = false;
    const absl::Time start = absl::Now();
    absl::Status s = failed               ? absl::OkStatus()
                     : device_ != nullptr ? StepOnDevice(work, &delta, &skipped)
                                          : StepOne(work, &delta, &skipped);
    const absl::Duration busy = absl::Now() - start;
    uint64_t params = 0;
    if (s.ok() && !failed && !skipped) {
      const Group& group = state_.groups[work.group];
      for (size_t t = 0; t < group.spec.tensors.size(); ++t) {
        if (work.step.tensors[t] & kTensorStep) params += group.spec.tensors[t];
      }
    }
    (device_ != nullptr ? delta.device_busy : delta.host_busy) = busy;
    (device_ != nullptr ? delta.device_params : delta.host_params) = params;
    if (skipped) delta.skipped_groups.push_back(work.group);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = s;
    AddStepStats(delta, &stats_);
    done_[work.group] = true;
    --outstanding_;
  }
}

absl::Status StepWorker::StepOne(const Work& w, OptimizerStepStats* delta, bool* skipped) {
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
                          [&] { return ReadAhead(w.group, k + 1, in_hand); })
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
    absl::MutexLock lock(&mu_);
    shard_time_ += absl::Now() - t0;
    ++shards_stepped_;
  }
  return absl::OkStatus();
}

}  // namespace tierd::internal
