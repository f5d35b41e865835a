// The optimizer's worker over a lane that only records what it is asked: the worker takes queued
// groups in the order queued on a thread of its own, keeps the step's first error and leaves the
// rest of that step alone, answers waits for a group, settles its lane once everything queued is
// taken, counts each lane's figures where they belong, and tells its lane which shards come next.
#include "client/optimizer_worker.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tierd::internal {
namespace {

// A lane that steps nothing: it records the groups it is given (and, when asked, what its worker
// expects after each), fails the groups it is told to, and holds a group until released.
class ScriptedLane : public Lane {
 public:
  struct Log {
    absl::Mutex mu;
    std::vector<size_t> stepped;
    std::vector<std::vector<ChunkId>> expected;  // at each step: expected(group, 1, 16)
    int settled = 0;
  };

  ScriptedLane(Log& log, bool device) : log_(log), device_(device) {}

  size_t fail_group = SIZE_MAX;  // its Step fails
  size_t skip_group = SIZE_MAX;  // its gradients are "not finite"
  size_t hold_group = SIZE_MAX;  // its Step waits for `release`
  absl::Notification release;
  absl::Status settle_error;

  absl::Status Step(const Work& w, const ExpectedShards& expected, OptimizerStepStats* delta,
                    bool* skipped) override {
    if (w.group == hold_group) release.WaitForNotification();
    absl::MutexLock lock(&log_.mu);
    log_.stepped.push_back(w.group);
    log_.expected.push_back(expected(w.group, 1, 16));
    delta->state_bytes += 1;
    if (w.group == fail_group) return absl::DataLossError("shard 0 went bad");
    *skipped = w.group == skip_group;
    return absl::OkStatus();
  }
  absl::Status ReadAhead(size_t g, size_t k, size_t, const ExpectedShards& expected) override {
    absl::MutexLock lock(&log_.mu);
    log_.expected.push_back(expected(g, k, 16));
    return absl::OkStatus();
  }
  absl::Status Settle() override {
    absl::MutexLock lock(&log_.mu);
    ++log_.settled;
    return settle_error;
  }
  bool on_device() const override { return device_; }

 private:
  Log& log_;
  const bool device_;
};

// Three groups of two shards each (ids 10 g + k + 1), 100 parameters a group, state at home on
// NVMe, and a worker over a scripted lane.
class StepWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_.options.home = Tier::kNvme;
    for (size_t g = 0; g < 3; ++g) {
      Group group;
      group.spec.name = "g" + std::to_string(g);
      group.spec.params = 100;
      group.spec.tensors = {100};
      group.initialized = true;
      for (size_t k = 0; k < 2; ++k) group.shards.push_back(Shard{.id = 10 * g + k + 1});
      state_.groups.push_back(std::move(group));
    }
  }

  // The worker, its lane scripted by `script` first.
  StepWorker& Start(bool device = false, void (*script)(ScriptedLane&) = nullptr) {
    auto lane = std::make_unique<ScriptedLane>(log_, device);
    lane_ = lane.get();
    if (script != nullptr) script(*lane);
    worker_ = std::make_unique<StepWorker>(state_, std::move(lane));
    worker_->expected_order = {0, 1, 2};
    worker_->Resize();
    return *worker_;
  }

  Work WorkFor(size_t g) {
    Work w{.group = g, .number = 1};
    w.step.tensors = flags_;  // its one tensor stepped
    return w;
  }
  void Enqueue(size_t g) { worker_->Enqueue(WorkFor(g), {1, 1}); }

  const std::vector<uint8_t> flags_{kTensorStep};
  StateRecord state_;
  ScriptedLane::Log log_;
  ScriptedLane* lane_ = nullptr;
  std::unique_ptr<StepWorker> worker_;
};

TEST_F(StepWorkerTest, TakesGroupsInTheOrderQueuedAndSettlesItsLaneOnceAllAreTaken) {
  StepWorker& w = Start();
  w.Begin();
  for (size_t g : {2, 0, 1}) Enqueue(g);
  ASSERT_TRUE(w.Settle().ok());
  absl::Status error;
  const OptimizerStepStats stats = w.Collect(&error);
  EXPECT_TRUE(error.ok()) << error;
  absl::MutexLock lock(&log_.mu);
  EXPECT_EQ(log_.stepped, (std::vector<size_t>{2, 0, 1}));
  EXPECT_EQ(log_.settled, 1);
  EXPECT_EQ(stats.state_bytes, 3u);
  EXPECT_EQ(stats.host_params, 300u);
  EXPECT_EQ(stats.device_params, 0u);
}

TEST_F(StepWorkerTest, ADeviceLanesFiguresAreTheDevicesAndASkippedGroupCountsNoParameters) {
  StepWorker& w = Start(/*device=*/true, [](ScriptedLane& l) { l.skip_group = 1; });
  w.Begin();
  for (size_t g : {0, 1}) Enqueue(g);
  ASSERT_TRUE(w.Settle().ok());
  absl::Status error;
  const OptimizerStepStats stats = w.Collect(&error);
  EXPECT_TRUE(error.ok()) << error;
  EXPECT_EQ(stats.device_params, 100u);
  EXPECT_EQ(stats.host_params, 0u);
  EXPECT_EQ(stats.skipped_groups, (std::vector<size_t>{1}));
}

TEST_F(StepWorkerTest, TheFirstErrorIsKeptAndTheRestOfThatStepIsLeftAsItIs) {
  StepWorker& w = Start(false, [](ScriptedLane& l) { l.fail_group = 0; });
  w.Begin();
  for (size_t g : {0, 1, 2}) Enqueue(g);
  for (size_t g : {0, 1, 2}) EXPECT_TRUE(w.WaitFor(g, absl::Seconds(10)).ok());  // taken
  ASSERT_TRUE(w.Settle().ok());
  absl::Status error;
  w.Collect(&error);
  EXPECT_EQ(error.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(error.message(), "shard 0 went bad");
  {
    absl::MutexLock lock(&log_.mu);
    EXPECT_EQ(log_.stepped, (std::vector<size_t>{0}));  // 1 and 2 were not given to the lane
  }
  w.End();
  // The next step starts without the error.
  w.Begin();
  Enqueue(1);
  ASSERT_TRUE(w.Settle().ok());
  w.Collect(&error);
  EXPECT_TRUE(error.ok()) << error;
}

TEST_F(StepWorkerTest, WaitingForAGroupAnswersWhenItIsDoneOrSaysWhyNot) {
  StepWorker& w = Start(false, [](ScriptedLane& l) { l.hold_group = 1; });
  w.Begin();
  EXPECT_EQ(w.WaitFor(0, absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
  Enqueue(1);
  Enqueue(0);
  EXPECT_EQ(w.WaitFor(1, absl::Milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(w.WaitFor(0, absl::Milliseconds(50)).code(), absl::StatusCode::kDeadlineExceeded);
  lane_->release.Notify();
  EXPECT_TRUE(w.WaitFor(1, absl::Seconds(10)).ok());
  EXPECT_TRUE(w.WaitFor(0, absl::Seconds(10)).ok());
  ASSERT_TRUE(w.Settle().ok());
  EXPECT_EQ(w.WaitFor(7, absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(StepWorkerTest, ALanesSettleErrorEndsTheStepsSettle) {
  StepWorker& w = Start();
  lane_->settle_error = absl::UnavailableError("the daemon went away");
  w.Begin();
  Enqueue(0);
  absl::StatusOr<absl::Duration> settled = w.Settle();
  EXPECT_EQ(settled.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(StepWorkerTest, TheLaneIsToldTheRestOfItsGroupThenTheQueueThenLastStepsOrder) {
  // Group 1 in hand with group 2 queued behind it: the rest of group 1 from shard 1, then group
  // 2 (queued), then group 0 (expected, not given yet).
  StepWorker& w = Start(false, [](ScriptedLane& l) { l.hold_group = 1; });
  w.Begin();
  Enqueue(1);
  Enqueue(2);
  lane_->release.Notify();
  ASSERT_TRUE(w.Settle().ok());
  absl::MutexLock lock(&log_.mu);
  ASSERT_EQ(log_.expected.size(), 2u);
  EXPECT_EQ(log_.expected[0], (std::vector<ChunkId>{12, 21, 22, 1, 2}));
  // At group 2 (the last queued): the rest of group 2, then group 0; group 1 has started.
  EXPECT_EQ(log_.expected[1], (std::vector<ChunkId>{22, 1, 2}));
}

TEST_F(StepWorkerTest, TheReadAheadLeavesOutResidentShardsDeviceGroupsAndHostHomes) {
  state_.groups[0].shards[1].resident = true;  // stays in the host tier: not read ahead
  state_.groups[2].on_device = true;           // the device lane's
  StepWorker& w = Start();
  ASSERT_TRUE(w.ReadAhead(std::string::npos, 0, 0).ok());  // before any group
  state_.options.home = Tier::kHost;                       // nothing streams
  ASSERT_TRUE(w.ReadAhead(std::string::npos, 0, 0).ok());
  absl::MutexLock lock(&log_.mu);
  ASSERT_EQ(log_.expected.size(), 2u);
  EXPECT_EQ(log_.expected[0], (std::vector<ChunkId>{1, 11, 12}));
  EXPECT_TRUE(log_.expected[1].empty());
}

}  // namespace
}  // namespace tierd::internal
