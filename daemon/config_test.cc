#include "daemon/config.h"
#include "daemon/config_flags.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "daemon/config_keys.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

std::string ReadSourceFile(const std::string& path) {
  std::ifstream in(TIERD_SOURCE_DIR "/" + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<DaemonConfig> FromArgs(std::vector<const char*> args) {
  args.insert(args.begin(), "tierd");
  absl::StatusOr<CommandLine> line = ParseCommandLine(args);
  if (!line.ok()) return line.status();
  return BuildConfig(*line);
}

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
  EXPECT_EQ(c.quotas.For(1000)[TierKind::kHost], 0u);  // none by default
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
  const TierKind host = TierKind::kHost, nvme = TierKind::kNvme;
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
  // Its values are the built-in defaults, as it says, and it names every key of the file.
  const DaemonConfig defaults = DefaultConfig();
  const std::string text = ReadSourceFile("deploy/tierd.toml");
  for (const ConfigKey& key : ConfigKeys()) {
    if (key.key.empty()) continue;
    EXPECT_EQ(ShowConfigValue(key, c), ShowConfigValue(key, defaults)) << key.key;
    const absl::string_view name = key.key.substr(key.key.find('.') + 1);
    const std::string spelled =
        key.key == "quota.users" ? "[[quota.users]]" : absl::StrCat(name, " =");
    EXPECT_NE(text.find(spelled), std::string::npos) << key.key << " is not in deploy/tierd.toml";
  }
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

// Flags go through the same table as the file: the same parsers, ranges and messages.
TEST(ConfigFlagsTest, EveryFormAbseilTakes) {
  absl::StatusOr<DaemonConfig> c = FromArgs(
      {"--host_capacity=2GiB", "--nvme_queue_depth", "64", "-log_level=debug", "--nvme_sqpoll",
       "--nolock_memory", "--emulated_gbps=12.5", "--metrics_listen=none",
       "--nvme_regions=/a:1GiB,/b:0", "--huge_pages", "never", "--nvme_io_backend=threads"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->host.capacity, 2ull << 30);
  EXPECT_EQ(c->nvme.queue_depth, 64u);
  EXPECT_EQ(c->log_level, "debug");
  EXPECT_TRUE(c->nvme.sqpoll);
  EXPECT_FALSE(c->host.lock_memory);
  EXPECT_DOUBLE_EQ(c->device.emulated_gbps, 12.5);
  EXPECT_EQ(c->metrics.listen, "");
  ASSERT_EQ(c->nvme.regions.size(), 2u);
  EXPECT_EQ(c->nvme.regions[1].path, "/b");
  EXPECT_EQ(c->host.huge_pages, HugePagePolicy::kNever);
  EXPECT_EQ(c->nvme.io_backend, IoBackendKind::kThreads);
  absl::StatusOr<DaemonConfig> off = FromArgs({"--nvme_sqpoll=true", "--nvme_sqpoll=false"});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->nvme.sqpoll);  // the last one wins
}

TEST(ConfigFlagsTest, FlagsOverrideTheFile) {
  const std::string path = testing::TempDir() + "/flags_override.toml";
  absl::Cleanup remove_file = [&path] { std::remove(path.c_str()); };
  std::ofstream(path) << "[host]\ncapacity = \"4GiB\"\nsegment_size = \"128MiB\"\n"
                         "[nvme]\nsqpoll = true\n[daemon]\nstate_dir = \"/srv/t\"\n";
  absl::StatusOr<DaemonConfig> c =
      FromArgs({"--config", path.c_str(), "--host_capacity=512MiB", "--nonvme_sqpoll"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->host.capacity, 512ull << 20);      // the flag
  EXPECT_EQ(c->host.segment_size, 128ull << 20);  // the file
  EXPECT_FALSE(c->nvme.sqpoll);                   // a flag may turn off what the file turned on
  EXPECT_EQ(c->nvme.regions[0].path, "/srv/t/nvme0.region");  // follows the file's state_dir
  absl::StatusOr<DaemonConfig> moved = FromArgs({"--config", path.c_str(), "--state_dir=/x"});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->nvme.regions[0].path, "/x/nvme0.region");
  absl::StatusOr<DaemonConfig> named =
      FromArgs({"--nvme_regions=/r:1GiB", "--state_dir=/y"});  // named regions stay
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->nvme.regions[0].path, "/r");
}

TEST(ConfigFlagsTest, BadFlagsNameThemselves) {
  for (auto [args, why] : std::vector<std::pair<std::vector<const char*>, const char*>>{
           {{"--frobnicate"}, "unknown flag --frobnicate"},
           {{"--nofrobnicate"}, "unknown flag --nofrobnicate"},
           {{"--nohost_capacity"}, "unknown flag --nohost_capacity"},  // not true/false
           {{"stray"}, "unexpected argument 'stray'"},
           {{"--host_capacity"}, "--host_capacity needs a value"},
           {{"--host_capacity=lots"}, "--host_capacity: "},
           {{"--nvme_queue_depth=0"}, "--nvme_queue_depth: must be an integer from 1 to 4096"},
           {{"--nvme_queue_depth=-3"}, "--nvme_queue_depth: must be an integer from 1 to 4096"},
           {{"--max_session_weight=1001"}, "--max_session_weight: must be an integer from 1"},
           {{"--emulated_gbps=0"}, "--emulated_gbps: must be a positive number"},
           {{"--emulated_gbps=nan"}, "--emulated_gbps: must be a positive number"},
           {{"--lock_memory=yes"}, "--lock_memory: must be true or false"},
           {{"--log_level=loud"}, "--log_level: log_level must be one of"},
           {{"--device=tpu"}, "--device: device backend must be auto, cuda, emulated or none"},
           {{"--huge_pages=sometimes"}, "--huge_pages: huge_pages must be"},
           {{"--socket_dir="}, "--socket_dir: must not be empty"},
           {{"--nvme_regions=/a"}, "--nvme_regions: NVMe region '/a' is not PATH:SIZE"},
           {{"--config=/nonexistent/tierd.toml"}, "cannot read config file"},
           {{"--host_capacity=24MiB", "--host_segment_size=16MiB"}, "host.capacity"}}) {
    absl::StatusOr<DaemonConfig> c = FromArgs(args);
    ASSERT_FALSE(c.ok()) << args[0];
    EXPECT_NE(c.status().message().find(why), std::string::npos) << c.status();
  }
}

TEST(ConfigFlagsTest, HelpAndVersionAreNotConfiguration) {
  std::vector<const char*> args = {"tierd", "--help"};
  absl::StatusOr<CommandLine> help = ParseCommandLine(args);
  ASSERT_TRUE(help.ok());
  EXPECT_TRUE(help->help);
  args = {"tierd", "--version"};
  EXPECT_TRUE(ParseCommandLine(args)->version);
  // The help names every flag with its key and the default the daemon really has.
  const std::string usage = UsageText();
  const DaemonConfig defaults = DefaultConfig();
  for (const ConfigKey& key : ConfigKeys()) {
    if (key.flag.empty()) continue;
    EXPECT_NE(usage.find(absl::StrCat("--", key.flag)), std::string::npos) << key.flag;
    if (!key.key.empty()) {
      EXPECT_NE(usage.find(absl::StrCat("[", key.key, ";")), std::string::npos) << key.key;
    }
  }
  EXPECT_NE(usage.find("[host.capacity; default 1GiB]"), std::string::npos) << usage;
}

// tierd --check: the configuration the flags and file make, one key a line, as Run would read it.
TEST(ConfigFlagsTest, CheckBuildsTheConfigurationAndShowsEveryKey) {
  std::vector<const char*> args = {"tierd", "--check", "--host_capacity", "64GiB",
                                   "--nvme_regions=/mnt/nvme0/tierd.region:1500GiB"};
  absl::StatusOr<CommandLine> line = ParseCommandLine(args);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_TRUE(line->check);
  absl::StatusOr<DaemonConfig> config = BuildConfig(*line);
  ASSERT_TRUE(config.ok()) << config.status();
  const std::string text = ConfigText(*config);
  EXPECT_NE(text.find("host.capacity = 64GiB\n"), std::string::npos) << text;
  EXPECT_NE(text.find("nvme.regions = /mnt/nvme0/tierd.region:1500GiB\n"), std::string::npos)
      << text;
  for (const ConfigKey& key : ConfigKeys()) {
    if (key.key.empty() || std::holds_alternative<Quotas*>(FieldTypeOf(key))) continue;
    EXPECT_NE(text.find(absl::StrCat(key.key, " = ")), std::string::npos) << key.key;
  }
  EXPECT_NE(UsageText().find("--check"), std::string::npos);
}

// Each key's value, spelled as a flag would, reads back to the same value.
TEST(ConfigKeysTest, EveryValueRoundTripsThroughItsFlagSpelling) {
  DaemonConfig c = DefaultConfig();
  ASSERT_TRUE(ApplyToml(R"(
[host]
capacity = 3221225472
segment_size = "1536KiB"
[nvme]
regions = [ { path = "/a", size = "1GiB" }, { path = "/b" } ]
io_size = 4097
[device]
emulated_gbps = 0.125
)",
                        "r.toml", &c)
                  .ok());
  for (const ConfigKey& key : ConfigKeys()) {
    const std::string shown = ShowConfigValue(key, c);
    if (key.key == "quota.users") continue;
    absl::StatusOr<ConfigValue> value = ReadConfigText(key, shown);
    ASSERT_TRUE(value.ok()) << key.key << key.flag << " '" << shown << "': " << value.status();
    DaemonConfig d = c;
    ASSERT_TRUE(StoreConfigValue(key, *value, &d).ok()) << key.key << key.flag;
    EXPECT_EQ(ShowConfigValue(key, d), shown) << key.key << key.flag;
  }
  EXPECT_EQ(SizeText(3ull << 30), "3GiB");
  EXPECT_EQ(SizeText(1536 << 10), "1536KiB");
  EXPECT_EQ(SizeText(4097), "4097");
}

// docs/configuration.md has a row for every key: its key, its flag and, where the default does not
// depend on the node, the built-in default.
TEST(ConfigKeysTest, TheDocumentationListsEveryKeyWithItsDefault) {
  const std::string doc = ReadSourceFile("docs/configuration.md");
  std::vector<std::vector<std::string>> rows;
  for (absl::string_view line : absl::StrSplit(doc, '\n')) {
    if (!absl::ConsumePrefix(&line, "| ")) continue;
    rows.push_back(absl::StrSplit(line, " | "));
  }
  const DaemonConfig defaults = DefaultConfig();
  for (const ConfigKey& key : ConfigKeys()) {
    const std::string key_cell = absl::StrCat("`", key.key, "`");
    const std::string flag_cell = absl::StrCat("`--", key.flag);
    const std::vector<std::string>* row = nullptr;
    for (const auto& r : rows) {
      if (r.size() < 3) continue;
      const bool same_key = key.key.empty()
                                ? r[0] == "—" && absl::StartsWith(r[1], flag_cell)
                                : r[0].find(key_cell) != std::string::npos ||
                                      (key.key == "quota.users" && r[0] == "`[[quota.users]]`");
      if (same_key) row = &r;
    }
    ASSERT_NE(row, nullptr) << (key.key.empty() ? key.flag : key.key)
                            << " has no row in docs/configuration.md";
    if (key.flag.empty()) {
      EXPECT_EQ((*row)[1], "—") << key.key;
    } else {
      EXPECT_TRUE(absl::StartsWith((*row)[1], flag_cell)) << key.key << ": " << (*row)[1];
    }
    if (key.default_note.empty()) {
      const std::string shown = absl::StrCat("`", ShowConfigValue(key, defaults), "`");
      EXPECT_TRUE(absl::StartsWith((*row)[2], shown))
          << (key.key.empty() ? key.flag : key.key) << ": the docs say " << (*row)[2]
          << ", the daemon " << shown;
    }
  }
}

}  // namespace
}  // namespace tierd::daemon
