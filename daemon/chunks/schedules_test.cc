// Schedules on their own: real sessions with their completion pages (the cursor is what the client
// writes there), a real ledger, a fake clock. The service's end-to-end trace and planner tests are
// in chunk_service_nvme_test.
#include "daemon/chunks/schedules.h"

#include <sys/mman.h>

#include <tuple>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint32_t kUid = 1000;

class SchedulesTest : public ::testing::Test {
 protected:
  SchedulesTest() : schedules_(chunks_, ledger_, clock_) {
    session_ = *sessions_.Open({kUid, kUid, 1}, "trainer");
    void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   session_->completions->fd(), 0);
    page_ = static_cast<CompletionPage*>(p);
    for (int i = 0; i < 4; ++i) chunks_.Insert(kUid, "", /*persistent=*/false);  // ids 1 to 4
  }
  ~SchedulesTest() override { munmap(page_, kCompletionPageBytes); }

  void Cursor(uint64_t steps_started) { page_->header.cursor.store(steps_started); }
  ScheduleRequest Steps(std::vector<std::vector<ChunkId>> steps) {
    ScheduleRequest r;
    for (const auto& step : steps) {
      auto& out = r.steps.emplace_back();
      for (ChunkId id : step) out.push_back({id, TierKind::kHost, Access::kRead});
    }
    return r;
  }
  void Version(uint32_t bit, bool set) {
    const uint64_t mask = uint64_t{1} << (bit % 64);
    if (set) {
      page_->header.versions[bit / 64].fetch_or(mask);
    } else {
      page_->header.versions[bit / 64].fetch_and(~mask);
    }
  }
  // One step reading each pair (first, other, version bit).
  static ScheduleRequest Pairs(std::vector<std::tuple<ChunkId, ChunkId, uint32_t>> pairs) {
    ScheduleRequest r;
    auto& step = r.steps.emplace_back();
    for (auto [first, other, bit] : pairs) {
      step.push_back({.id = first,
                      .tier = TierKind::kHost,
                      .access = Access::kRead,
                      .other = other,
                      .version_bit = bit});
    }
    return r;
  }
  static std::vector<ChunkId> Ids(const Schedules::Round& round) {
    std::vector<ChunkId> ids;
    for (const ScheduledAccess& a : (*round.sessions.at(0).steps).at(0)) {
      EXPECT_EQ(a.other, 0u);  // the planner sees resolved accesses only
      ids.push_back(a.id);
    }
    return ids;
  }
  Schedules::Round Collect() {
    Schedules::Round round;
    schedules_.Collect(clock_.Now(), &round);
    return round;
  }

  ChunkTable chunks_;
  TenantLedger ledger_;
  FakeClock clock_;
  Schedules schedules_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> session_;
  CompletionPage* page_ = nullptr;
};

TEST_F(SchedulesTest, StepTimesFollowTheCursorsPaceOnTheShortSide) {
  Cursor(1);
  schedules_.Set(*session_, Steps({{1}, {2}}));
  for (uint64_t c = 2; c <= 9; ++c) {  // every step takes 100 ms
    clock_.Advance(absl::Milliseconds(100));
    Cursor(c);
    Collect();
  }
  Schedules::Round round = Collect();
  ASSERT_EQ(round.sessions.size(), 1u);
  const SessionPlan& plan = round.sessions[0];
  EXPECT_EQ(plan.cursor, 9u);
  ASSERT_EQ(plan.step_time->size(), 2u);
  for (absl::Duration t : *plan.step_time) {
    // Below the pace (planned short), and converging on it as the deviation decays.
    EXPECT_LT(t, absl::Milliseconds(100));
    EXPECT_GT(t, absl::Milliseconds(50));
  }
  EXPECT_EQ(round.named, (absl::flat_hash_set<ChunkId>{1, 2}));
  EXPECT_EQ(schedules_.FiguresOf(session_->id).steps, 2u);
}

TEST_F(SchedulesTest, StepsNotTimedYetArePlannedAsTheMeanOfThoseThatAre) {
  Cursor(1);
  schedules_.Set(*session_, Steps({{1}, {2}, {3}, {4}}));
  // Before any step has passed, nothing is known: every step is planned as none.
  const Schedules::Round first = Collect();
  for (absl::Duration t : *first.sessions.at(0).step_time) EXPECT_EQ(t, absl::ZeroDuration());
  // Nor after a step that took no measurable time (step 0).
  Cursor(2);
  const Schedules::Round instant = Collect();
  for (absl::Duration t : *instant.sessions.at(0).step_time) EXPECT_EQ(t, absl::ZeroDuration());
  clock_.Advance(absl::Milliseconds(100));
  Cursor(3);
  Collect();
  clock_.Advance(absl::Milliseconds(300));
  Cursor(4);
  const Schedules::Round round = Collect();
  const std::vector<absl::Duration>& times = *round.sessions.at(0).step_time;
  ASSERT_EQ(times.size(), 4u);
  // Steps 1 and 2 are timed (short of 100 and 300 ms); 0 and 3 are planned as their mean.
  EXPECT_GT(times[1], absl::ZeroDuration());
  EXPECT_LT(times[1], absl::Milliseconds(100));
  EXPECT_LT(times[2], absl::Milliseconds(300));
  EXPECT_GT(times[2], times[1]);
  EXPECT_EQ(times[0], (times[1] + times[2]) / 2);
  EXPECT_EQ(times[3], times[0]);
}

TEST_F(SchedulesTest, AJumpOfTheCursorUpdatesEachStepOnceAtMost) {
  Cursor(1);
  schedules_.Set(*session_, Steps({{1}, {2}, {3}}));
  clock_.Advance(absl::Seconds(30));
  Cursor(1'000'001);  // a client's cursor is any number it writes
  Schedules::Round round = Collect();
  ASSERT_EQ(round.sessions.size(), 1u);
  for (absl::Duration t : *round.sessions[0].step_time) {
    EXPECT_GE(t, absl::ZeroDuration());
    EXPECT_LT(t, absl::Milliseconds(1));  // 30 s over a million steps
  }
}

TEST_F(SchedulesTest, ATraceBecomesTheScheduleOnceItsIterationHasPassed) {
  Cursor(1);
  ScheduleRequest trace;
  trace.trace_steps = 2;  // from step 2, the next multiple of 2
  schedules_.Set(*session_, trace);
  EXPECT_EQ(schedules_.count(), 1u);
  EXPECT_TRUE(schedules_.FiguresOf(session_->id).tracing);
  ChunkMeta* one = &chunks_.at(1);
  ChunkMeta* two = &chunks_.at(2);
  ChunkMeta* three = &chunks_.at(3);
  schedules_.Record(*session_, {&one, 1}, TierKind::kHost, Access::kRead);  // before it: ignored
  Cursor(3);                                                                // step 2
  schedules_.Record(*session_, {&two, 1}, TierKind::kHost, Access::kRead);
  schedules_.Record(*session_, {&two, 1}, TierKind::kHost, Access::kWrite);  // read, then written
  Cursor(4);                                                                 // step 3
  schedules_.Record(*session_, {&three, 1}, TierKind::kDevice, Access::kRead);
  EXPECT_TRUE(Collect().sessions.empty());  // still recording
  Cursor(5);
  Schedules::Round round = Collect();
  ASSERT_EQ(round.sessions.size(), 1u);
  const Schedule& steps = *round.sessions[0].steps;
  ASSERT_EQ(steps.size(), 2u);
  ASSERT_EQ(steps[0].size(), 1u);
  EXPECT_EQ(steps[0][0].id, 2u);
  EXPECT_EQ(steps[0][0].access, Access::kWrite);
  ASSERT_EQ(steps[1].size(), 1u);
  EXPECT_EQ(steps[1][0].id, 3u);
  EXPECT_EQ(steps[1][0].tier, TierKind::kDevice);
  EXPECT_FALSE(schedules_.FiguresOf(session_->id).tracing);
  EXPECT_EQ(ledger_.UsageOf(kUid).schedule_accesses, 2u);
}

// A round that installs a trace plans it as of the round's own time: a running step started
// later than the round's `now` would put the new schedule's every deadline late.
TEST_F(SchedulesTest, ATraceInstalledByARoundStartsAtTheRoundsTime) {
  ScheduleRequest trace;
  trace.trace_steps = 1;
  schedules_.Set(*session_, trace);
  Cursor(1);
  ChunkMeta* one = &chunks_.at(1);
  schedules_.Record(*session_, {&one, 1}, TierKind::kHost, Access::kRead);
  Cursor(2);
  const absl::Time round_time = clock_.Now();
  clock_.Advance(absl::Milliseconds(50));  // the round took its time before it got the lock
  Schedules::Round round;
  schedules_.Collect(round_time, &round);
  ASSERT_EQ(round.sessions.size(), 1u);
  EXPECT_EQ(round.sessions[0].step_started, round_time);
}

TEST_F(SchedulesTest, ATracedChunkFreedBeforeTheEndIsLeftOutAndAnEmptyTraceInstallsNothing) {
  ScheduleRequest trace;
  trace.trace_steps = 1;
  schedules_.Set(*session_, trace);
  Cursor(1);
  ChunkMeta* four = &chunks_.at(4);
  schedules_.Record(*session_, {&four, 1}, TierKind::kHost, Access::kRead);
  chunks_.Erase(chunks_.at(4));  // freed
  Cursor(2);
  EXPECT_TRUE(Collect().sessions.empty());
  EXPECT_EQ(schedules_.count(), 0u);
  EXPECT_EQ(ledger_.UsageOf(kUid).schedule_accesses, 0u);
}

TEST_F(SchedulesTest, ReplacingAScheduleCountsOnlyTheNewOneAndTheEndGivesItBack) {
  Limits limits;
  limits.schedule_accesses_per_session = 3;
  ledger_.Configure(limits, {});
  schedules_.Set(*session_, Steps({{1, 2}, {3}}));
  EXPECT_EQ(ledger_.UsageOf(kUid).schedule_accesses, 3u);
  // Another of three replaces it: the held three do not count twice.
  EXPECT_TRUE(schedules_.CheckLimits(*session_, Steps({{1}, {2}, {3}})).ok());
  absl::Status over = schedules_.CheckLimits(*session_, Steps({{1, 2, 3, 4}}));
  EXPECT_TRUE(absl::IsResourceExhausted(over)) << over;
  schedules_.Set(*session_, Steps({{4}}));
  EXPECT_EQ(ledger_.UsageOf(kUid).schedule_accesses, 1u);
  schedules_.End(*session_);
  EXPECT_EQ(ledger_.UsageOf(kUid).schedule_accesses, 0u);
  EXPECT_EQ(schedules_.count(), 0u);
  EXPECT_TRUE(Collect().sessions.empty());
}

TEST_F(SchedulesTest, APairIsReadAtTheVersionItsBitSays) {
  schedules_.Set(*session_, Pairs({{1, 2, 0}, {3, 4, 700}}));
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{1, 3}));
  Version(700, true);  // the client flipped one thing's version: no new schedule
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{1, 4}));
  Version(0, true);
  Version(700, false);
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{2, 3}));
  EXPECT_EQ(Collect().named, (absl::flat_hash_set<ChunkId>{1, 2, 3, 4}));  // both of each pair
  EXPECT_EQ(Collect().unread, (absl::flat_hash_set<ChunkId>{1, 4}));       // the versions unread
}

TEST_F(SchedulesTest, PairsAtOneVersionAreOneAccessOfTheirStep) {
  // A unit's ranges: one pair of chunks each, a bit each, flipped together by a step.
  schedules_.Set(*session_, Pairs({{1, 2, 5}, {1, 2, 6}}));
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{1}));
  Version(5, true);
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{2, 1}));
  Version(6, true);
  EXPECT_EQ(Ids(Collect()), (std::vector<ChunkId>{2}));
}

TEST_F(SchedulesTest, ARoundReusesTheResolvedScheduleWhileNoBitChanged) {
  schedules_.Set(*session_, Pairs({{1, 2, 9}}));
  Schedules::Round first = Collect();
  Schedules::Round second = Collect();
  EXPECT_EQ(first.steps.at(0).get(), second.steps.at(0).get());
  Version(9, true);
  EXPECT_NE(Collect().steps.at(0).get(), first.steps.at(0).get());
}

}  // namespace
}  // namespace tierd::daemon
