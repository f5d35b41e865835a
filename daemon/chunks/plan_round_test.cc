// PlanRound over what it stands on, all real: a host tier and an NVMe region in a file, the chunk
// table, Space, the Mover, a session's schedule in its completion page. It is tested here as the
// service runs it (collect, plan, apply) without the service: what it collects, and which planned
// moves it starts now that the table may have changed since the plan.
#include "daemon/chunks/plan_round.h"

#include <sys/mman.h>

#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "testing/scratch_tiers.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000;

class PlanRoundTest : public ::testing::Test, public Mover::Listener {
 protected:
  void SetUp() override {
    ledger_.Configure(Limits{}, Quotas{});
    auto rig = testing::ScratchTiers::Make(
        {.segment_size = kSeg, .host_bytes = 4 * kSeg, .nvme_bytes = 64u << 20});
    rig_ = std::move(rig).value();  // dies with the error when the tiers cannot be made
    const Tiers tiers = rig_->tiers();
    space_ = std::make_unique<Space>(chunks_, ledger_, tiers, Clock::Real());
    mover_ = std::make_unique<Mover>(mu_, chunks_, *space_, tiers, meter_, Clock::Real(), *this);
    schedules_ = std::make_unique<Schedules>(chunks_, ledger_, Clock::Real());
    round_ = std::make_unique<PlanRound>(chunks_, *space_, *mover_, sessions_, *schedules_, meter_,
                                         tiers, Clock::Real());
    session_ = *registry_.Open({kAlice, kAlice, 1}, "trainer");
  }
  void TearDown() override {
    if (mover_ != nullptr) mover_->WaitForIdle();
    round_.reset();
    schedules_.reset();
    mover_.reset();
    space_.reset();
    rig_.reset();
  }

  // A chunk of the session's whose only copy is on NVMe (never written: it reads as zeros).
  ChunkMeta& NvmeChunk() {
    ChunkMeta& c = chunks_.Insert(kAlice, "", /*persistent=*/false);
    c.owner = session_->id;
    c.size = kSeg;
    c.placement[TierKind::kNvme] = *space_->Reserve(TierKind::kNvme, UserOwner(kAlice), kSeg);
    c.allocated.insert(TierKind::kNvme);
    c.resident.insert(TierKind::kNvme);
    chunks_.Reindex(c);
    return c;
  }
  // One step reading `ids` on the host.
  void Schedule(std::vector<ChunkId> ids) {
    ScheduleRequest r;
    auto& step = r.steps.emplace_back();
    for (ChunkId id : ids) step.push_back({.id = id, .tier = TierKind::kHost});
    schedules_->Set(*session_, std::move(r));
  }
  static PlannedMove Fetch(ChunkId id) {
    return {.kind = PlannedMove::Kind::kFetch, .id = id, .tier = TierKind::kHost};
  }

  void MoveSettled(ChunkMeta&, const Mover::Settlement& settled) override {
    EXPECT_TRUE(settled.status.ok()) << settled.status;
  }

  std::unique_ptr<testing::ScratchTiers> rig_;
  absl::Mutex mu_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  PathMeter meter_;
  SessionLedger sessions_;
  SessionRegistry registry_;
  std::shared_ptr<Session> session_;
  std::unique_ptr<Space> space_;
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<Schedules> schedules_;
  std::unique_ptr<PlanRound> round_;
};

TEST_F(PlanRoundTest, WithoutAScheduleThereIsNothingToCollect) {
  absl::MutexLock lock(&mu_);
  NvmeChunk();
  Schedules::Round round;
  PlanInput in;
  EXPECT_FALSE(round_->Collect(absl::Now(), round, in));
  EXPECT_TRUE(in.sessions.empty());
  EXPECT_TRUE(in.chunks.empty());
}

TEST_F(PlanRoundTest, CollectTakesTheScheduledChunksAndTheTiersRoomButNotTheRest) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& named = NvmeChunk();
  ChunkMeta& other = NvmeChunk();  // on NVMe only, named by no schedule: no planner's business
  Schedule({named.id});
  Schedules::Round round;
  PlanInput in;
  ASSERT_TRUE(round_->Collect(absl::Now(), round, in));
  ASSERT_EQ(in.sessions.size(), 1u);
  EXPECT_EQ(in.sessions[0].session, session_->id);
  ASSERT_EQ(in.sessions[0].steps->size(), 1u);
  EXPECT_TRUE(in.chunks.contains(named.id));
  EXPECT_FALSE(in.chunks.contains(other.id));
  EXPECT_TRUE(in.chunks.at(named.id).resident.contains(TierKind::kNvme));
  EXPECT_FALSE(in.chunks.at(named.id).transient);
  EXPECT_EQ(in.capacity[TierKind::kHost], 4 * kSeg);
  EXPECT_EQ(in.free[TierKind::kHost], 4 * kSeg);
}

TEST_F(PlanRoundTest, APairsVersionNoStepReadsIsMarkedUnreadAsTheBitsSay) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& first = NvmeChunk();
  ChunkMeta& other = NvmeChunk();
  ChunkMeta& plain = NvmeChunk();
  ScheduleRequest r;
  r.steps.push_back({{.id = first.id, .tier = TierKind::kHost, .other = other.id, .version_bit = 7},
                     {.id = plain.id, .tier = TierKind::kHost}});
  schedules_->Set(*session_, std::move(r));
  Schedules::Round round;
  PlanInput in;
  ASSERT_TRUE(round_->Collect(absl::Now(), round, in));
  EXPECT_FALSE(first.unread_version);  // bit 7 clear: the step reads `first`
  EXPECT_TRUE(other.unread_version);
  EXPECT_FALSE(plain.unread_version);
  EXPECT_TRUE(in.chunks.at(other.id).unread_version);

  // The client sets the bit (new weights in `other`): the next round sees it.
  void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                 session_->completions->fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  static_cast<CompletionPage*>(p)->header.versions[0].fetch_or(uint64_t{1} << 7);
  munmap(p, kCompletionPageBytes);
  Schedules::Round next;
  PlanInput again;
  ASSERT_TRUE(round_->Collect(absl::Now(), next, again));
  EXPECT_TRUE(first.unread_version);
  EXPECT_FALSE(other.unread_version);

  // No schedule left: nothing is unread any more.
  schedules_->Set(*session_, ScheduleRequest{});
  Schedules::Round none;
  PlanInput empty;
  EXPECT_FALSE(round_->Collect(absl::Now(), none, empty));
  EXPECT_FALSE(first.unread_version);
}

TEST_F(PlanRoundTest, ATransientChunkIsTransientToThePlanner) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& grads = NvmeChunk();
  grads.transient = true;  // as Allocate makes it for ChunkRequest::transient
  Schedule({grads.id});
  Schedules::Round round;
  PlanInput in;
  ASSERT_TRUE(round_->Collect(absl::Now(), round, in));
  EXPECT_TRUE(in.chunks.at(grads.id).transient);
}

TEST_F(PlanRoundTest, APrefetchsWantGoesToThePlannerAndStampsKeepThePlansNextUsesBesideIt) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  ChunkMeta& asked = NvmeChunk();
  ChunkMeta& scheduled = NvmeChunk();
  for (ChunkMeta* c : {&asked, &scheduled}) {  // both with a host copy
    c->placement[TierKind::kHost] = *space_->Reserve(TierKind::kHost, UserOwner(kAlice), kSeg);
    c->allocated.insert(TierKind::kHost);
    c->resident.insert(TierKind::kHost);
    chunks_.Reindex(*c);
  }
  Want(asked, TierKind::kHost, now + absl::Seconds(1), /*by_plan=*/false);
  Schedule({scheduled.id});
  Schedules::Round round;
  PlanInput in;
  ASSERT_TRUE(round_->Collect(now, round, in));
  EXPECT_EQ(in.chunks.at(asked.id).asked, now + absl::Seconds(1));
  EXPECT_EQ(in.chunks.at(scheduled.id).asked, absl::InfiniteFuture());

  std::vector<NextUse> uses;
  Plan(in, &uses);
  round_->Stamp(uses, now);
  EXPECT_EQ(WantedAt(scheduled, TierKind::kHost, now), now);  // the schedule's only step
  EXPECT_TRUE(scheduled.wanted_by_plan);
  EXPECT_EQ(WantedAt(asked, TierKind::kHost, now), now + absl::Seconds(1));  // the Prefetch's
  EXPECT_FALSE(asked.wanted_by_plan);

  // A stamp is the planner's, not a Prefetch's: the next round's input does not take it as one,
  // and a round whose plan no longer needs the copy takes the stamp away.
  Schedules::Round again;
  PlanInput next;
  ASSERT_TRUE(round_->Collect(now, again, next));
  EXPECT_EQ(next.chunks.at(scheduled.id).asked, absl::InfiniteFuture());
  round_->Stamp({{scheduled.id, TierKind::kHost, absl::InfiniteFuture()}}, now);
  EXPECT_EQ(WantedAt(scheduled, TierKind::kHost, now), absl::InfiniteFuture());
}

TEST_F(PlanRoundTest, RoomThatCopiesPlacedOutsideAPlanHeldIsKeptFreeForThemForAWhile) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  ChunkMeta& scheduled = NvmeChunk();
  ChunkMeta& acquired = NvmeChunk();  // a step's gradients, say: no schedule names them
  ChunkMeta& planned = NvmeChunk();
  Schedule({scheduled.id});
  ASSERT_TRUE(space_->PlaceIn(acquired, TierKind::kHost).ok());  // room for an Acquire
  space_->set_planning(true);
  ASSERT_TRUE(space_->PlaceIn(planned, TierKind::kHost).ok());  // room for a planned fetch
  space_->set_planning(false);
  EXPECT_TRUE(acquired.unplanned.contains(TierKind::kHost));
  EXPECT_FALSE(planned.unplanned.contains(TierKind::kHost));
  auto headroom = [&](absl::Time at) {
    Schedules::Round round;
    PlanInput in;
    EXPECT_TRUE(round_->Collect(at, round, in));
    return in.headroom[TierKind::kHost];
  };
  // While the copy holds its room, nothing more is kept for it.
  EXPECT_EQ(headroom(now), 0u);
  // Once it goes, its room stays kept for it for the window, and then no longer.
  space_->DropCopy(acquired, TierKind::kHost);
  EXPECT_FALSE(acquired.unplanned.contains(TierKind::kHost));
  EXPECT_EQ(headroom(now + absl::Milliseconds(500)), kSeg);
  EXPECT_EQ(headroom(now + PlanRound::kUnplannedWindow + absl::Milliseconds(1)), 0u);
  // The planned copy's room counts for nothing when it goes.
  space_->DropCopy(planned, TierKind::kHost);
  EXPECT_EQ(headroom(now + PlanRound::kUnplannedWindow + absl::Milliseconds(2)), 0u);
}

TEST_F(PlanRoundTest, ApplyStartsAPlannedFetchAndCountsItToTheChunksSession) {
  ChunkMeta* c;
  {
    absl::MutexLock lock(&mu_);
    c = &NvmeChunk();
    sessions_.Of(*session_);
    EXPECT_EQ(round_->Apply({Fetch(c->id)}), 1u);
    EXPECT_EQ(c->state, ChunkState::kMoving);
    EXPECT_EQ(c->moving_to, TierKind::kHost);
    EXPECT_EQ(sessions_.Find(session_->id)->stats.planner_fetches, 1u);
  }
  mover_->WaitForIdle();
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(c->resident.contains(TierKind::kHost));
}

TEST_F(PlanRoundTest, ApplySkipsMovesTheTableNoLongerAllows) {
  absl::MutexLock lock(&mu_);
  ChunkMeta& pinned = NvmeChunk();
  ChunkMeta& doomed = NvmeChunk();
  pinned.pins = 1;       // acquired since the plan: not the planner's to move
  doomed.doomed = true;  // freed since the plan
  const ChunkId gone = 999'999;
  EXPECT_EQ(round_->Apply({Fetch(pinned.id), Fetch(doomed.id), Fetch(gone)}), 0u);
  EXPECT_EQ(pinned.state, ChunkState::kReady);
  EXPECT_EQ(doomed.state, ChunkState::kReady);
  // A drop of a chunk's only copy would lose it: refused too.
  ChunkMeta& only = NvmeChunk();
  EXPECT_EQ(
      round_->Apply({{.kind = PlannedMove::Kind::kDrop, .id = only.id, .tier = TierKind::kNvme}}),
      0u);
  EXPECT_TRUE(only.resident.contains(TierKind::kNvme));
}

}  // namespace
}  // namespace tierd::daemon
