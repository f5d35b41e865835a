#include "daemon/config.h"

#include "gtest/gtest.h"

namespace tierd::daemon {
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

TEST(ConfigTest, NvmeKeysAndTheStateDirectory) {
  DaemonConfig c = DefaultConfig();
  ASSERT_TRUE(ApplyToml(R"(
[daemon]
state_dir = "/var/lib/tierd"
[nvme]
regions = [ { path = "/mnt/nvme0/tierd.region", size = "800GiB" }, { path = "/dev/nvme1n1" } ]
stripe_unit = "2MiB"
io_size = "512KiB"
queue_depth = 64
sqpoll = true
index_size = "128MiB"
)",
                        "nvme.toml", &c)
                  .ok());
  EXPECT_EQ(c.state_dir, "/var/lib/tierd");
  ASSERT_EQ(c.nvme.regions.size(), 2u);
  EXPECT_EQ(c.nvme.regions[0].size, 800ull << 30);
  EXPECT_EQ(c.nvme.regions[1].path, "/dev/nvme1n1");
  EXPECT_EQ(c.nvme.regions[1].size, 0u);  // the whole device
  EXPECT_EQ(c.nvme.stripe_unit, 2u << 20);
  EXPECT_EQ(c.nvme.io_size, 512u << 10);
  EXPECT_EQ(c.nvme.queue_depth, 64u);
  EXPECT_TRUE(c.nvme.sqpoll);
  EXPECT_EQ(c.nvme.index_size, 128u << 20);
}

TEST(ConfigTest, DefaultRegionFollowsTheStateDirectory) {
  DaemonConfig c = DefaultConfig();
  ASSERT_TRUE(ApplyToml("[daemon]\nstate_dir = \"/srv/tierd\"\n", "s.toml", &c).ok());
  ASSERT_EQ(c.nvme.regions.size(), 1u);
  EXPECT_EQ(c.nvme.regions[0].path, "/srv/tierd/nvme0.region");
  ASSERT_TRUE(ApplyToml("[nvme]\nregions = []\n", "s.toml", &c).ok());
  EXPECT_TRUE(c.nvme.regions.empty());
}

TEST(ConfigTest, DeviceKeys) {
  DaemonConfig c = DefaultConfig();
  EXPECT_EQ(c.device.backend, "auto");
  ASSERT_TRUE(ApplyToml(R"(
[device]
backend = "emulated"
capacity = "2GiB"
segment_size = "64MiB"
emulated_gbps = 12.5
emulated_latency_us = 3
)",
                        "d.toml", &c)
                  .ok());
  EXPECT_EQ(c.device.backend, "emulated");
  EXPECT_EQ(c.device.capacity, 2ull << 30);
  EXPECT_EQ(c.device.segment_size, 64u << 20);
  EXPECT_DOUBLE_EQ(c.device.emulated_gbps, 12.5);
  EXPECT_EQ(c.device.emulated_latency_us, 3);
  absl::Status bad = ApplyToml("[device]\nbackend = \"tpu\"\n", "d.toml", &c);
  EXPECT_TRUE(absl::IsInvalidArgument(bad));
  EXPECT_NE(bad.message().find("auto, cuda, emulated or none"), std::string::npos) << bad;
}

TEST(ConfigTest, PlannerKeys) {
  DaemonConfig c = DefaultConfig();
  EXPECT_EQ(c.planner.probe_bytes, 64u << 20);
  EXPECT_EQ(c.planner.max_session_weight, 16u);
  ASSERT_TRUE(ApplyToml("[planner]\nprobe_bytes = 0\nmax_session_weight = 4\n", "p.toml", &c).ok());
  EXPECT_EQ(c.planner.probe_bytes, 0u);
  EXPECT_EQ(c.planner.max_session_weight, 4u);
  for (const char* bad :
       {"[planner]\nmax_session_weight = 0\n", "[planner]\nmax_session_weight = \"heavy\"\n",
        "[planner]\nprobe_bytes = \"lots\"\n"}) {
    absl::Status s = ApplyToml(bad, "p.toml", &c);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad;
    EXPECT_NE(s.message().find("p.toml:2"), std::string::npos) << s;
  }
  EXPECT_EQ(c.planner.max_session_weight, 4u);  // a bad value changes nothing
}

TEST(ConfigTest, LimitsAndQuotas) {
  DaemonConfig c = DefaultConfig();
  EXPECT_EQ(c.limits.sessions_per_uid, 128u);
  EXPECT_EQ(c.quotas.For(1000)[static_cast<int>(TierKind::kHost)], 0u);  // none by default
  absl::Status s = ApplyToml(R"(
[limits]
connections_per_uid = 32
sessions_per_uid = 16
chunks_per_session = 5000
chunks_per_uid = 10000
schedule_accesses_per_session = 4096
schedule_accesses_per_uid = 8192
trace_steps = 512
[quota]
host = "64GiB"
nvme = "1TiB"
[[quota.users]]
uid = 1000
host = "128GiB"
[[quota.users]]
user = "root"
nvme = 0
)",
                             "q.toml", &c);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.limits.connections_per_uid, 32u);
  EXPECT_EQ(c.limits.sessions_per_uid, 16u);
  EXPECT_EQ(c.limits.chunks_per_session, 5000u);
  EXPECT_EQ(c.limits.chunks_per_uid, 10000u);
  EXPECT_EQ(c.limits.schedule_accesses_per_session, 4096u);
  EXPECT_EQ(c.limits.schedule_accesses_per_uid, 8192u);
  EXPECT_EQ(c.limits.trace_steps, 512u);
  const int host = static_cast<int>(TierKind::kHost), nvme = static_cast<int>(TierKind::kNvme);
  EXPECT_EQ(c.quotas.For(2000)[host], 64ull << 30);  // everyone's
  EXPECT_EQ(c.quotas.For(1000)[host], 128ull << 30);
  EXPECT_EQ(c.quotas.For(1000)[nvme], 1ull << 40);  // what the entry does not name stays
  EXPECT_EQ(c.quotas.For(0)[nvme], 0u);             // 0: no quota for root on NVMe
  EXPECT_EQ(c.quotas.names.at(0), "root");
  for (auto [bad, why] :
       {std::pair{"[limits]\nsessions_per_uid = 0\n",
                  "limits.sessions_per_uid: must be an integer"},
        std::pair{"[limits]\nsessions = 3\n", "limits.sessions: unknown key"},
        std::pair{"[quota]\ngpu = \"1GiB\"\n", "quota.gpu: unknown key"},
        std::pair{"[quota]\nhost = \"lots\"\n", "quota.host"},
        std::pair{"[[quota.users]]\nhost = \"1GiB\"\n", "either a uid or a user"},
        std::pair{"[[quota.users]]\nuser = \"no-such-user-here\"\n", "no user named"},
        std::pair{"[[quota.users]]\nuid = 5\n[[quota.users]]\nuid = 5\n", "two quota entries"}}) {
    DaemonConfig d = DefaultConfig();
    absl::Status e = ApplyToml(bad, "q.toml", &d);
    EXPECT_TRUE(absl::IsInvalidArgument(e)) << bad;
    EXPECT_NE(e.message().find(why), std::string::npos) << e;
  }
}

TEST(ConfigTest, CrossKeyChecksRunBeforeAnythingStarts) {
  DaemonConfig c = DefaultConfig();
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.host.capacity = 24 << 20;
  c.host.segment_size = 16 << 20;
  EXPECT_NE(ValidateConfig(c).message().find("host.capacity"), std::string::npos);
  c = DefaultConfig();
  c.nvme.regions = {{"/a", 1 << 30}, {"/a", 1 << 30}};
  EXPECT_NE(ValidateConfig(c).message().find("lists '/a' twice"), std::string::npos);
  c = DefaultConfig();
  c.nvme.io_size = 3 << 20;
  EXPECT_NE(ValidateConfig(c).message().find("nvme.io_size"), std::string::npos);
}

TEST(ConfigTest, RegionListFlagParsesAndRejectsGarbage) {
  auto two = ParseRegionList("/a:1GiB,/b:0");
  ASSERT_TRUE(two.ok());
  EXPECT_EQ((*two)[0].size, 1ull << 30);
  EXPECT_TRUE(ParseRegionList("none")->empty());
  EXPECT_TRUE(absl::IsInvalidArgument(ParseRegionList("/a").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseRegionList("/a:lots").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(ParseRegionList(",").status()));
}

// The example every operator starts from must load as it ships.
TEST(ConfigTest, ShippedExampleConfigLoads) {
  DaemonConfig c = DefaultConfig();
  absl::Status s = ApplyTomlFile(TIERD_SOURCE_DIR "/deploy/tierd.toml", &c);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.host.capacity, 1ull << 30);
  EXPECT_EQ(c.nvme.stripe_unit, 1u << 20);
  EXPECT_EQ(c.nvme.queue_depth, 32u);
  // Its values are the built-in defaults, as it says.
  const DaemonConfig defaults = DefaultConfig();
  EXPECT_EQ(c.nvme.index_size, defaults.nvme.index_size);
  EXPECT_EQ(c.nvme.io_backend, defaults.nvme.io_backend);
  EXPECT_EQ(c.limits.connections_per_uid, defaults.limits.connections_per_uid);
  EXPECT_EQ(c.limits.sessions_per_uid, defaults.limits.sessions_per_uid);
  EXPECT_EQ(c.limits.chunks_per_session, defaults.limits.chunks_per_session);
  EXPECT_EQ(c.limits.chunks_per_uid, defaults.limits.chunks_per_uid);
  EXPECT_EQ(c.limits.schedule_accesses_per_session, defaults.limits.schedule_accesses_per_session);
  EXPECT_EQ(c.limits.schedule_accesses_per_uid, defaults.limits.schedule_accesses_per_uid);
  EXPECT_EQ(c.limits.trace_steps, defaults.limits.trace_steps);
  EXPECT_EQ(c.quotas.per_uid, defaults.quotas.per_uid);
  EXPECT_TRUE(c.quotas.by_uid.empty());
}

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
}  // namespace tierd::daemon
