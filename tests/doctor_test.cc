// `tierctl doctor` run as an operator runs it: against a real daemon, without one, and where
// io_uring is refused as under Docker's default seccomp profile.
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/daemon_process.h"

namespace tierd {
namespace {

std::string Tierctl() { return testing::ExecutableDir() + "/../tools/tierctl"; }

// The JSON object of one check, as tierctl prints it.
std::string CheckOf(const std::string& json, const std::string& name) {
  const size_t at = json.find("{\"name\":\"" + name + "\"");
  if (at == std::string::npos) return "";
  return json.substr(at, json.find('}', at) - at + 1);
}

TEST(DoctorTest, ReportsEveryProbeAgainstARunningDaemon) {
  auto daemon = testing::DaemonProcess::Start(
      {.binary = testing::ExecutableDir() + "/../daemon/tierd",
       .args = {"--host_capacity=64MiB", "--host_segment_size=16MiB", "--lock_memory=false"}});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::string out;
  const int rc = testing::RunProcess(
      {Tierctl(), "--socket_dir=" + (*daemon)->socket_dir(), "--json", "doctor"}, &out);
  for (const char* name :
       {"daemon", "sockets", "io_uring", "o_direct", "memlock", "huge_pages", "cuda.driver"}) {
    EXPECT_NE(CheckOf(out, name), "") << name << " missing from " << out;
  }
  EXPECT_NE(CheckOf(out, "daemon").find("\"result\":\"ok\""), std::string::npos) << out;
  EXPECT_NE(CheckOf(out, "sockets").find("\"result\":\"ok\""), std::string::npos) << out;
  // The daemon's own region and host capacity are what get checked.
  EXPECT_NE(CheckOf(out, "o_direct").find((*daemon)->socket_dir() + "/nvme0.region"),
            std::string::npos)
      << out;
  EXPECT_NE(CheckOf(out, "o_direct").find("\"result\":\"ok\""), std::string::npos) << out;
  const std::string memlock = CheckOf(out, "memlock");
  EXPECT_TRUE(memlock.find("unlimited") != std::string::npos ||
              memlock.find("64 MiB") != std::string::npos)
      << memlock;
  // Without a CUDA driver every CUDA line says so; with one, each says what it found.
  if (access("/dev/nvidiactl", F_OK) != 0) {
    for (const char* name : {"cuda.driver", "cuda.host_register", "cuda.vmm_fd_ipc",
                             "cuda.legacy_ipc", "cuda.stream_wait"}) {
      const std::string c = CheckOf(out, name);
      EXPECT_NE(c.find("\"result\":\"skip\""), std::string::npos) << name << ": " << c;
    }
  }
  // Exit status 1 exactly when something failed.
  EXPECT_EQ(rc, out.find("\"fail\":0") != std::string::npos ? 0 : 1) << out;
}

TEST(DoctorTest, SaysIoUringIsBlockedAndWhatTheDaemonDoesInstead) {
  std::string out;
  testing::RunProcess({Tierctl(), "--socket_dir=/nonexistent", "--json", "doctor"}, &out,
                      /*without_io_uring=*/true);
  const std::string c = CheckOf(out, "io_uring");
  EXPECT_NE(c.find("\"result\":\"warn\""), std::string::npos) << c;
  EXPECT_NE(c.find("EPERM"), std::string::npos) << c;
  EXPECT_NE(c.find("thread-pool"), std::string::npos) << c;
  EXPECT_NE(c.find("seccomp"), std::string::npos) << c;
}

TEST(DoctorTest, FailsASocketDirectoryOthersCanWriteAndANonexistentRegionDirectory) {
  char dir[] = "/tmp/tierd-doctor-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  chmod(dir, 0777);
  std::string out;
  const int rc = testing::RunProcess(
      {Tierctl(), absl::StrCat("--socket_dir=", dir), "--json", "doctor",
       absl::StrCat("--regions=", dir, "/missing/r.region"), "--host_capacity=1GiB"},
      &out);
  rmdir(dir);
  EXPECT_EQ(rc, 1) << out;
  const std::string sockets = CheckOf(out, "sockets");
  EXPECT_NE(sockets.find("\"result\":\"fail\""), std::string::npos) << sockets;
  EXPECT_NE(sockets.find("0777"), std::string::npos) << sockets;
  const std::string region = CheckOf(out, "o_direct");
  EXPECT_NE(region.find("\"result\":\"fail\""), std::string::npos) << region;
  EXPECT_NE(region.find("create "), std::string::npos) << region;
  EXPECT_NE(CheckOf(out, "daemon").find("\"result\":\"warn\""), std::string::npos) << out;
}

TEST(DoctorTest, BadUsageExitsTwo) {
  std::string out;
  EXPECT_EQ(testing::RunProcess({Tierctl(), "doctor", "--host_capacity=lots"}, &out), 2) << out;
  EXPECT_EQ(testing::RunProcess({Tierctl(), "doctor", "--colour"}, &out), 2) << out;
}

}  // namespace
}  // namespace tierd
