#include "daemon/chunks/session_ledger.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace tierd::daemon {
namespace {

std::unique_ptr<Session> Make(SessionId id, std::string job = "") {
  auto s = std::make_unique<Session>();
  s->id = id;
  s->peer = {1000, 1000, static_cast<pid_t>(40 + id)};
  s->client_name = "trainer";
  s->job = std::move(job);
  return s;
}

TEST(SessionsTest, EveryFigureCountsForTheSessionAndTheNode) {
  SessionLedger sessions;
  const auto a = Make(1), b = Make(2);
  sessions.CountAcquired(sessions.Of(*a), /*ready=*/true);
  sessions.CountAcquired(sessions.Of(*b), /*ready=*/false);
  sessions.AddStall(2, TierKind::kHost, absl::Milliseconds(5));
  sessions.CountPlanner(1, SessionLedger::PlannerMove::kFetch);
  sessions.CountPlanner(2, SessionLedger::PlannerMove::kWriteBack);
  sessions.CountPlanner(9, SessionLedger::PlannerMove::kDrop);  // a chunk whose holder has gone
  EXPECT_EQ(sessions.Find(1)->stats.ready, 1u);
  EXPECT_EQ(sessions.Find(2)->stats.waited, 1u);
  EXPECT_EQ(sessions.Find(2)->stats.stall[TierKind::kHost], absl::Milliseconds(5));
  EXPECT_EQ(sessions.Find(1)->stats.planner_fetches, 1u);
  EXPECT_EQ(sessions.Find(2)->stats.planner_write_backs, 1u);
  const SessionStats& node = sessions.totals();
  EXPECT_EQ(node.ready, 1u);
  EXPECT_EQ(node.waited, 1u);
  EXPECT_EQ(node.stall[TierKind::kHost], absl::Milliseconds(5));
  EXPECT_EQ(node.planner_fetches, 1u);
  EXPECT_EQ(node.planner_write_backs, 1u);
  EXPECT_EQ(node.planner_drops, 1u);  // the node's count keeps it
}

TEST(SessionsTest, AJobsTrafficLastsUntilItsLastSessionEnds) {
  SessionLedger sessions;
  const auto a = Make(1, "run-42"), b = Make(2, "run-42"), c = Make(3);
  sessions.Of(*a);
  sessions.Of(*b);
  sessions.Of(*c);
  PathArray<uint64_t> bytes;
  bytes[Path::kNvmeToHost] = 100;
  sessions.AddMoved(1, bytes);
  sessions.AddMoved(2, bytes);
  sessions.AddMoved(3, bytes);  // no job: its own figure only
  EXPECT_EQ(sessions.Find(3)->moved[Path::kNvmeToHost], 100u);
  EXPECT_EQ(sessions.JobTraffic().at("run-42")[Path::kNvmeToHost], 200u);
  ASSERT_TRUE(sessions.End(1).has_value());
  EXPECT_EQ(sessions.JobTraffic().count("run-42"), 1u);
  EXPECT_EQ(sessions.End(2)->job, "run-42");
  EXPECT_TRUE(sessions.JobTraffic().empty());
  EXPECT_FALSE(sessions.End(2).has_value());  // once
}

TEST(SessionsTest, NvmeIoIsOrderedByTheHoldersWeight) {
  SessionLedger sessions;
  sessions.Of(*Make(1)).weight = 4;
  const absl::Time due = absl::FromUnixSeconds(100);
  const IoOrder mine = sessions.OrderFor(1, due);
  EXPECT_EQ(mine.deadline, due);
  EXPECT_EQ(mine.flow, 1u);
  EXPECT_EQ(mine.weight, 4u);
  EXPECT_EQ(sessions.OrderFor(7, due).weight, 1u);  // a detached chunk's I/O: the default share
}

TEST(SessionsTest, ALeaseKeepsOthersOutUnlessEveryHolderShares) {
  SessionLedger sessions;
  const auto a = Make(1);
  sessions.Of(*a);
  sessions.Grant(/*id=*/10, 1, /*shared=*/false);
  absl::Status s = sessions.CheckLease(10, "ckpt/0", 2, /*shared=*/true, "open");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find(a->Describe()), std::string::npos) << s;     // names the holder
  EXPECT_TRUE(sessions.CheckLease(10, "ckpt/0", 1, false, "free").ok());  // its own

  sessions.Grant(11, 1, /*shared=*/true);
  EXPECT_TRUE(sessions.CheckLease(11, "ckpt/1", 2, /*shared=*/true, "open").ok());
  EXPECT_FALSE(sessions.CheckLease(11, "ckpt/1", 2, /*shared=*/true, "free").ok());
  EXPECT_EQ(sessions.Join(11, 2, true), 1u);  // the first holder stays the chunk's owner
  EXPECT_EQ(sessions.Join(11, 3, true), 1u);
  EXPECT_EQ(sessions.Leave(11, 1), 2u);  // the next holder takes over
  EXPECT_EQ(sessions.Leave(11, 2), 3u);
  EXPECT_EQ(sessions.Leave(11, 3), 0u);  // nobody: detached
  EXPECT_EQ(sessions.Leave(11, 3), std::nullopt);
  EXPECT_TRUE(sessions.CheckLease(11, "ckpt/1", 2, false, "free").ok());
}

}  // namespace
}  // namespace tierd::daemon
