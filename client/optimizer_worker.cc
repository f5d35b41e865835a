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
  into->device_kept_bytes += from.device_kept_bytes;
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

StepWorker::StepWorker(StateRecord& state, std::unique_ptr<Lane> lane)
    : state_(state),
      lane_(std::move(lane)),
      expected_([this](size_t g, size_t k, size_t want) { return Expected(g, k, want); }) {
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
  return lane_->ReadAhead(g, k, in_hand, expected_);
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
  if (absl::Status s = lane_->Settle(); !s.ok()) return s;
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
    absl::Status s = failed ? absl::OkStatus() : lane_->Step(work, expected_, &delta, &skipped);
    const absl::Duration busy = absl::Now() - start;
    uint64_t params = 0;
    if (s.ok() && !failed && !skipped) {
      const Group& group = state_.groups[work.group];
      for (size_t t = 0; t < group.spec.tensors.size(); ++t) {
        if (work.step.tensors[t] & kTensorStep) params += group.spec.tensors[t];
      }
    }
    (lane_->on_device() ? delta.device_busy : delta.host_busy) = busy;
    (lane_->on_device() ? delta.device_params : delta.host_params) = params;
    if (skipped) delta.skipped_groups.push_back(work.group);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = s;
    AddStepStats(delta, &stats_);
    done_[work.group] = true;
    --outstanding_;
  }
}

}  // namespace tierd::internal
