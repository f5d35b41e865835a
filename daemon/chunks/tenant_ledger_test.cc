// The ledger on its own: what each user holds against its limits and quotas, the refusals that
// name the limit and are counted, and users forgotten once they hold nothing.
#include "daemon/chunks/tenant_ledger.h"

#include <string>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint32_t kAlice = 1000;
constexpr uint32_t kBob = 1001;

class TenantLedgerTest : public ::testing::Test {
 protected:
  TenantLedgerTest() {
    Limits limits;
    limits.chunks_per_session = 3;
    limits.chunks_per_uid = 5;
    limits.schedule_accesses_per_session = 100;
    limits.schedule_accesses_per_uid = 150;
    limits.trace_steps = 10;
    Quotas quotas;
    quotas.per_uid[TierKind::kHost] = 1000;
    quotas.by_uid[kBob][TierKind::kHost] = 0;  // bob: no host quota
    quotas.by_uid[kBob][TierKind::kNvme] = 50;
    ledger_.Configure(limits, quotas);
  }
  uint64_t Refusals(uint32_t uid, LimitKind kind) {
    return ledger_.UsageOf(uid).refusals[static_cast<int>(kind)];
  }
  static bool Names(const absl::Status& s, const std::string& what) {
    return s.message().find(what) != absl::string_view::npos;
  }

  TenantLedger ledger_;
};

TEST_F(TenantLedgerTest, BytesWithinTheQuotaPassAndTheFirstByteBeyondIsRefusedByName) {
  EXPECT_EQ(ledger_.Headroom(kAlice, TierKind::kHost), 1000u);
  ASSERT_TRUE(ledger_.CheckBytes(kAlice, TierKind::kHost, 1000).ok());
  ledger_.AddBytes(kAlice, TierKind::kHost, 600);
  EXPECT_EQ(ledger_.Headroom(kAlice, TierKind::kHost), 400u);
  EXPECT_TRUE(ledger_.CheckBytes(kAlice, TierKind::kHost, 400).ok());
  absl::Status s = ledger_.CheckBytes(kAlice, TierKind::kHost, 401);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Names(s, "quota.host")) << s;
  EXPECT_TRUE(Names(s, "uid 1000")) << s;
  EXPECT_EQ(Refusals(kAlice, LimitKind::kHostQuota), 1u);
  EXPECT_EQ(ledger_.UsageOf(kAlice).bytes[TierKind::kHost], 600u);  // a refusal takes nothing
}

TEST_F(TenantLedgerTest, AUsersOwnQuotaReplacesTheDefaultTierByTier) {
  EXPECT_EQ(ledger_.Headroom(kBob, TierKind::kHost), UINT64_MAX);  // 0: no quota
  EXPECT_TRUE(ledger_.CheckBytes(kBob, TierKind::kHost, uint64_t{1} << 40).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(ledger_.CheckBytes(kBob, TierKind::kNvme, 51)));
  EXPECT_EQ(Refusals(kBob, LimitKind::kNvmeQuota), 1u);
  EXPECT_EQ(ledger_.Headroom(kAlice, TierKind::kNvme), UINT64_MAX);  // no default NVMe quota
}

TEST_F(TenantLedgerTest, RemovingMoreThanHeldStopsAtZeroAndAnEmptyUserIsForgotten) {
  ledger_.AddBytes(kAlice, TierKind::kHost, 100);
  ledger_.AddChunks(kAlice, 2);
  ledger_.RemoveBytes(kAlice, TierKind::kHost, 500);
  EXPECT_EQ(ledger_.UsageOf(kAlice).bytes[TierKind::kHost], 0u);
  ASSERT_EQ(ledger_.Usage().count(kAlice), 1u);  // still holds chunks
  ledger_.AddChunks(kAlice, -7);
  EXPECT_EQ(ledger_.Usage().count(kAlice), 0u);
  ledger_.RemoveBytes(kBob, TierKind::kHost, 1);  // never held anything: nothing to do
  EXPECT_TRUE(ledger_.Usage().empty());
}

TEST_F(TenantLedgerTest, ChunksAreBoundedPerSessionThenPerUser) {
  EXPECT_TRUE(ledger_.CheckChunks(kAlice, 0, 3).ok());
  absl::Status s = ledger_.CheckChunks(kAlice, 2, 2);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Names(s, "limits.chunks_per_session")) << s;
  ledger_.AddChunks(kAlice, 4);  // held by other sessions of the user
  s = ledger_.CheckChunks(kAlice, 0, 2);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Names(s, "limits.chunks_per_uid")) << s;
  EXPECT_TRUE(ledger_.CheckChunks(kAlice, 0, 1).ok());
  EXPECT_EQ(Refusals(kAlice, LimitKind::kChunksPerSession), 1u);
  EXPECT_EQ(Refusals(kAlice, LimitKind::kChunksPerUid), 1u);
}

TEST_F(TenantLedgerTest, AScheduleThatReplacesAnotherCountsOnlyTheNewOne) {
  EXPECT_TRUE(absl::IsResourceExhausted(ledger_.CheckSchedule(kAlice, 0, 101, "SetSchedule")));
  ledger_.AddScheduleAccesses(kAlice, 100);
  // 100 held: 60 more would pass the user's 150, but replacing the 100 leaves 60.
  absl::Status s = ledger_.CheckSchedule(kAlice, 0, 60, "SetSchedule");
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Names(s, "limits.schedule_accesses_per_uid")) << s;
  EXPECT_TRUE(ledger_.CheckSchedule(kAlice, 100, 60, "SetSchedule").ok());
  EXPECT_EQ(Refusals(kAlice, LimitKind::kScheduleAccessesPerSession), 1u);
  EXPECT_EQ(Refusals(kAlice, LimitKind::kScheduleAccessesPerUid), 1u);
}

TEST_F(TenantLedgerTest, ATraceLongerThanTheLimitIsRefused) {
  EXPECT_TRUE(ledger_.CheckTrace(kAlice, 10).ok());
  absl::Status s = ledger_.CheckTrace(kAlice, 11);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Names(s, "limits.trace_steps")) << s;
}

TEST_F(TenantLedgerTest, EveryLimitHasItsConfigKeysName) {
  for (int k = 0; k < kLimitKinds; ++k) {
    EXPECT_NE(std::string(LimitName(static_cast<LimitKind>(k))), "?") << k;
  }
}

}  // namespace
}  // namespace tierd::daemon
