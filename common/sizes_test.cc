#include "common/sizes.h"

#include "gtest/gtest.h"

namespace tierd {
namespace {

TEST(SizesTest, ParsesPlainAndSuffixedSizes) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("64KiB"), 64 * kKiB);
  EXPECT_EQ(*ParseSize("256MiB"), 256 * kMiB);
  EXPECT_EQ(*ParseSize("2G"), 2 * kGiB);
  EXPECT_EQ(*ParseSize(" 1.5 GiB "), 3 * kGiB / 2);
  EXPECT_EQ(*ParseSize("1tib"), kTiB);
}

TEST(SizesTest, RejectsGarbageWithTheReason) {
  EXPECT_TRUE(absl::IsInvalidArgument(ParseSize("").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseSize("MiB").status()));
  absl::Status unit = ParseSize("12 parsecs").status();
  EXPECT_TRUE(absl::IsInvalidArgument(unit));
  EXPECT_NE(unit.message().find("unknown unit"), absl::string_view::npos);
  EXPECT_TRUE(absl::IsInvalidArgument(ParseSize("0.3B").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseSize("99999999999TiB").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseSize("-1").status()));
}

TEST(SizesTest, FormatsReadably) {
  EXPECT_EQ(FormatSize(4096), "4 KiB");
  EXPECT_EQ(FormatSize(3 * kGiB / 2), "1.50 GiB");
  EXPECT_EQ(FormatSize(100), "100 B");
}

}  // namespace
}  // namespace tierd
