#include "daemon/types/tiers.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tierd::daemon {
namespace {

TEST(LadderTest, EachTierWritesDownToTheOneBelowOverItsPath) {
  EXPECT_EQ(Below(TierKind::kDevice), TierKind::kHost);
  EXPECT_EQ(Below(TierKind::kHost), TierKind::kNvme);
  EXPECT_EQ(Below(TierKind::kNvme), std::nullopt);  // the bottom
  // Down leaves a tier for the one below it; up arrives in a tier from the one below.
  EXPECT_EQ(PathDown(TierKind::kDevice), Path::kDeviceToHost);
  EXPECT_EQ(PathDown(TierKind::kHost), Path::kHostToNvme);
  EXPECT_EQ(PathUp(TierKind::kDevice), Path::kHostToDevice);
  EXPECT_EQ(PathUp(TierKind::kHost), Path::kNvmeToHost);
  for (TierKind t : {TierKind::kDevice, TierKind::kHost}) {
    EXPECT_TRUE(Above(t, *Below(t)));
    EXPECT_FALSE(Above(*Below(t), t));
  }
  EXPECT_FALSE(Above(TierKind::kHost, TierKind::kHost));
}

TEST(LadderTest, ACopyIsCleanWhenATierBelowHoldsOneToo) {
  TierSet resident;
  EXPECT_FALSE(CleanIn(resident, TierKind::kDevice));  // no copy at all
  resident.insert(TierKind::kDevice);
  EXPECT_FALSE(CleanIn(resident, TierKind::kDevice));  // the only copy
  resident.insert(TierKind::kNvme);
  EXPECT_TRUE(CleanIn(resident, TierKind::kDevice));  // NVMe's, two tiers below, counts
  EXPECT_FALSE(CleanIn(resident, TierKind::kNvme));   // nothing below the bottom
  EXPECT_FALSE(CleanIn(resident, TierKind::kHost));   // no host copy to be clean
  resident.insert(TierKind::kHost);
  EXPECT_TRUE(CleanIn(resident, TierKind::kHost));
  resident.erase(TierKind::kNvme);
  EXPECT_TRUE(CleanIn(resident, TierKind::kDevice));
  EXPECT_FALSE(CleanIn(resident, TierKind::kHost));
}

TEST(TierArrayTest, HoldsOneValuePerTierInTheEnumsOrder) {
  TierArray<int> a;
  for (int v : a) EXPECT_EQ(v, 0);  // value-initialised
  a[TierKind::kDevice] = 3;
  a[TierKind::kHost] = 1;
  EXPECT_EQ(std::vector<int>(a.begin(), a.end()), (std::vector<int>{1, 0, 3}));
  EXPECT_EQ(TierArray<int>::Filled(7)[TierKind::kNvme], 7);
  std::vector<std::string> names;
  for (TierKind t : kAllTiers) names.emplace_back(TierName(t));
  EXPECT_EQ(names, (std::vector<std::string>{"host", "nvme", "device"}));

  PathArray<int> p;
  p[Path::kDeviceToHost] = 4;
  EXPECT_EQ(std::vector<int>(p.begin(), p.end()), (std::vector<int>{0, 0, 0, 4}));
  EXPECT_STREQ(PathName(kAllPaths[3]), "device_to_host");
}

TEST(TierArrayTest, TheWireNamesEachTierAndNothingElse) {
  for (TierKind t : kAllTiers) EXPECT_EQ(TierFromWire(WireValue(t)), t);
  EXPECT_EQ(TierFromWire(0), std::nullopt);  // TIER_UNSPECIFIED
  EXPECT_EQ(TierFromWire(4), std::nullopt);
  EXPECT_EQ(TierFromWire(-1), std::nullopt);
}

}  // namespace
}  // namespace tierd::daemon
