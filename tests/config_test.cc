#include "daemon/config.h"

#include "gtest/gtest.h"

namespace tierd {
namespace {

TEST(ConfigTest, AppliesEveryKey) {
  DaemonConfig c = DefaultConfig();
  absl::Status s = ApplyToml(R"(
[daemon]
socket_dir = "/run/tierd"
socket_group = "tierd"
log_level = "debug"
[host]
capacity = "64GiB"
segment_size = 134217728
huge_pages = "require"
lock_memory = false
)",
                             "test.toml", &c);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.socket_dir, "/run/tierd");
  EXPECT_EQ(c.socket_group, "tierd");
  EXPECT_EQ(c.log_level, "debug");
  EXPECT_EQ(c.host.capacity, 64ull << 30);
  EXPECT_EQ(c.host.segment_size, 128ull << 20);
  EXPECT_EQ(c.host.huge_pages, HugePagePolicy::kRequire);
  EXPECT_FALSE(c.host.lock_memory);
}

TEST(ConfigTest, EmptyDocumentKeepsDefaults) {
  DaemonConfig c = DefaultConfig();
  ASSERT_TRUE(ApplyToml("", "empty.toml", &c).ok());
  EXPECT_EQ(c.host.capacity, 1ull << 30);
  EXPECT_EQ(c.host.segment_size, 256ull << 20);
  EXPECT_TRUE(c.host.lock_memory);
}

// Each bad document fails with INVALID_ARGUMENT and a message naming the file, line and key.
struct BadCase {
  const char* name;
  const char* toml;
  const char* expect_in_message;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class ConfigErrorTest : public testing::TestWithParam<BadCase> {};

TEST_P(ConfigErrorTest, FailsWithFileLineAndKey) {
  DaemonConfig c = DefaultConfig();
  absl::Status s = ApplyToml(GetParam().toml, "bad.toml", &c);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find(GetParam().expect_in_message), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("bad.toml:"), absl::string_view::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ConfigErrorTest,
    testing::Values(
        BadCase{"MisspelledKey", "[host]\ncapcity = 1\n", "host.capcity: unknown key"},
        BadCase{"UnknownSection", "[hots]\ncapacity = 1\n", "unknown section"},
        BadCase{"SizeWithoutNumber", "[host]\ncapacity = \"lots\"\n", "host.capacity"},
        BadCase{"NegativeSize", "[host]\ncapacity = -5\n", "must not be negative"},
        BadCase{"UnknownHugePagePolicy", "[host]\nhuge_pages = \"sometimes\"\n", "host.huge_pages"},
        BadCase{"BooleanAsString", "[host]\nlock_memory = \"yes\"\n", "true or false"},
        BadCase{"UnknownLogLevel", "[daemon]\nlog_level = \"loud\"\n", "daemon.log_level"},
        BadCase{"NumberForAString", "[daemon]\nsocket_dir = 5\n", "must be a string"},
        BadCase{"MissingValue", "[daemon]\nsocket_dir = \n", "bad.toml:2"},
        BadCase{"UnclosedSection", "[daemon\n", "bad.toml:1"}),
    [](const testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(ConfigTest, MissingFileIsNotFound) {
  DaemonConfig c = DefaultConfig();
  absl::Status s = ApplyTomlFile("/nonexistent/tierd.toml", &c);
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
}

TEST(ConfigTest, HugePagePolicyNamesRoundTrip) {
  for (auto p : {HugePagePolicy::kAuto, HugePagePolicy::kNever, HugePagePolicy::kRequire}) {
    EXPECT_EQ(*ParseHugePagePolicy(HugePagePolicyName(p)), p);
  }
}

}  // namespace
}  // namespace tierd
