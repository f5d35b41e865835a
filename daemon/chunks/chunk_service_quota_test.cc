// The chunk service's limits and quotas on a real NVMe tier: a user's bytes per tier, room made
// from its own copies only, chunks and schedules per session and per user, each refusal named.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/chunks/chunk_service_nvme_fixture.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

// --- What one user may hold: quotas per tier and limits on chunks and schedules. ---
TEST_F(ChunkServiceNvmeTest, AUsersQuotaLimitsWhatItsChunksHoldInATierAndNamesIt) {
  Quotas q;
  q.per_uid[TierKind::kHost] = 8 << 20;
  q.by_uid[2000] = {};  // a user with no quota at all
  service_->set_limits(Limits{}, q);
  Alloc(*session_, {4 << 20, 4 << 20});
  std::vector<ChunkRequest> more = {{.size = 4 << 20}};
  auto refused = service_->Allocate(*session_, more);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("quota of 8 MiB (quota.host)"), std::string::npos)
      << refused.status();
  // Another user's quota is its own.
  auto other = *sessions_.Open({2000, 2000, 2}, "other");
  MapPage(*other);
  Alloc(*other, {4 << 20, 4 << 20, 4 << 20});
  const TenantUsage mine = service_->tenant_usage(1000);
  EXPECT_EQ(mine.bytes[TierKind::kHost], 8u << 20);
  EXPECT_EQ(mine.chunks, 2u);
  EXPECT_EQ(mine.refusals[static_cast<int>(LimitKind::kHostQuota)], 1u);
  EXPECT_EQ(service_->tenant_usage(2000).bytes[TierKind::kHost], 12u << 20);
}

// At its quota, a user's fetch makes room from its own copies, never another user's.
TEST_F(ChunkServiceNvmeTest, AUserAtItsQuotaMakesRoomFromItsOwnCleanCopiesOnly) {
  Quotas q;
  q.by_uid[1000][TierKind::kHost] = 8 << 20;
  service_->set_limits(Limits{}, q);
  auto other = *sessions_.Open({2000, 2000, 2}, "other");
  MapPage(*other);
  auto theirs = Alloc(*other, {4 << 20});  // used least recently of all
  Write(*other, theirs, 1);
  ASSERT_TRUE(Wait(*other, service_->Evict(*other, theirs, TierKind::kNvme, true)).ok());
  auto away = Alloc(*session_, {4 << 20});
  Write(*session_, away, 2);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto mine = Alloc(*session_, {4 << 20, 4 << 20});
  Write(*session_, mine, 3);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, mine, TierKind::kNvme, true)).ok());
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, away, TierKind::kHost, 0)).ok());
  EXPECT_TRUE(service_->Stat(*other, theirs)->at(0).resident.contains(TierKind::kHost));
  auto stat = *service_->Stat(*session_, mine);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));  // its least recently used
  EXPECT_TRUE(stat[1].resident.contains(TierKind::kHost));
  EXPECT_TRUE(Check(*session_, away, 2, {4 << 20}));
}

TEST_F(ChunkServiceNvmeTest, AUserAtItsQuotaWritesItsOwnDirtyCopiesDownToMakeRoom) {
  Quotas q;
  q.by_uid[1000][TierKind::kHost] = 8 << 20;
  service_->set_limits(Limits{}, q);
  auto away = Alloc(*session_, {4 << 20});
  Write(*session_, away, 4);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto dirty = Alloc(*session_, {4 << 20, 4 << 20});  // the quota, written only on the host
  Write(*session_, dirty, 5);
  EXPECT_TRUE(Check(*session_, away, 4, {4 << 20}));  // an Acquire: one dirty copy goes down
  EXPECT_EQ(service_->tenant_usage(1000).bytes[TierKind::kHost], 8u << 20);
  EXPECT_TRUE(Check(*session_, dirty, 5, {4 << 20, 4 << 20}));
}

TEST_F(ChunkServiceNvmeTest, ChunksPerSessionAndPerUserAreLimitedByName) {
  Limits l;
  l.chunks_per_session = 3;
  l.chunks_per_uid = 5;
  service_->set_limits(l, Quotas{});
  Alloc(*session_, {4096, 4096, 4096});
  std::vector<ChunkRequest> one = {{.size = 4096}};
  auto refused = service_->Allocate(*session_, one);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("limits.chunks_per_session (3)"), std::string::npos)
      << refused.status();
  auto second = *sessions_.Open({1000, 1000, 2}, "same user");
  MapPage(*second);
  auto two = Alloc(*second, {4096, 4096});
  refused = service_->Allocate(*second, one);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("limits.chunks_per_uid (5)"), std::string::npos)
      << refused.status();
  ASSERT_TRUE(service_->Free(*second, {two.data(), 1}).ok());
  EXPECT_TRUE(service_->Allocate(*second, one).ok());
  EXPECT_EQ(service_->CloseSession(*second), 2u);
  EXPECT_EQ(service_->tenant_usage(1000).chunks, 3u);
}

TEST_F(ChunkServiceNvmeTest, SchedulesAndTracesAreLimitedPerSessionAndPerUser) {
  Limits l;
  l.schedule_accesses_per_session = 4;
  l.schedule_accesses_per_uid = 6;
  l.trace_steps = 8;
  service_->set_limits(l, Quotas{});
  auto ids = Alloc(*session_, {4096, 4096, 4096, 4096, 4096});
  auto schedule = [&](size_t accesses) {
    ScheduleRequest r;
    for (size_t i = 0; i < accesses; ++i) r.steps.push_back({{ids[i], TierKind::kHost}});
    return r;
  };
  absl::Status s = service_->SetSchedule(*session_, schedule(5));
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.schedule_accesses_per_session (4)"), std::string::npos) << s;
  ASSERT_TRUE(service_->SetSchedule(*session_, schedule(4)).ok());
  ASSERT_TRUE(service_->SetSchedule(*session_, schedule(3)).ok());  // replaces: 3 held, not 7
  ScheduleRequest empty_steps;  // many steps, few accesses: the steps count
  empty_steps.steps.resize(5);
  empty_steps.steps[0] = {{ids[0], TierKind::kHost}};
  EXPECT_TRUE(absl::IsResourceExhausted(service_->SetSchedule(*session_, empty_steps)));
  auto second = *sessions_.Open({1000, 1000, 2}, "same user");
  std::vector<ChunkRequest> four(4, ChunkRequest{.size = 4096});
  auto theirs = *service_->Allocate(*second, four);
  ScheduleRequest r;
  for (ChunkId id : theirs) r.steps.push_back({{id, TierKind::kHost}});
  s = service_->SetSchedule(*second, r);
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.schedule_accesses_per_uid (6)"), std::string::npos) << s;
  ScheduleRequest trace;
  trace.trace_steps = 9;
  s = service_->SetSchedule(*second, trace);
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.trace_steps (8)"), std::string::npos) << s;
  service_->CloseSession(*session_);  // its schedule no longer counts
  EXPECT_TRUE(service_->SetSchedule(*second, r).ok());
  EXPECT_EQ(service_->tenant_usage(1000).schedule_accesses, 4u);
}

// Persistent chunks belong to their user, not a session: they count against its quota after its
// sessions have ended.
TEST_F(ChunkServiceNvmeTest, PersistentChunksCountAgainstTheirUsersQuotaAfterItsSessionsEnd) {
  Quotas q;
  q.per_uid[TierKind::kNvme] = 16 << 20;
  service_->set_limits(Limits{}, q);
  auto first = *sessions_.Open({1000, 1000, 2}, "first");
  MapPage(*first);
  std::vector<ChunkRequest> r = {{.size = 12 << 20, .name = "job/big", .persistent = true}};
  auto big = *service_->Allocate(*first, r);
  Write(*first, big, 6);
  ASSERT_TRUE(Wait(*first, service_->Evict(*first, big, TierKind::kNvme)).ok());
  service_->CloseSession(*first);
  EXPECT_EQ(service_->tenant_usage(1000).bytes[TierKind::kNvme], 12u << 20);
  r = {{.size = 8 << 20, .name = "job/more", .persistent = true}};
  auto more = *service_->Allocate(*session_, r);
  Write(*session_, more, 7);
  const absl::Status s = Wait(*session_, service_->Evict(*session_, more, TierKind::kNvme));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("quota.nvme"), std::string::npos) << s;
}

}  // namespace
}  // namespace tierd::daemon
