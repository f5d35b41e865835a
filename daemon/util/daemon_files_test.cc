// The daemon's own directories, locks and state files.
#include "daemon/util/daemon_files.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "daemon/tiers/nvme/nvme_tier.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

class DaemonFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tierd-files-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Runs `body` in a child process in which no file may grow (writes fail with EFBIG, as on a
  // full file system); returns its exit status.
  template <typename Body>
  int OnAFullFileSystem(Body body) {
    const pid_t pid = fork();
    if (pid == 0) {
      rlimit none{0, 0};
      setrlimit(RLIMIT_FSIZE, &none);
      signal(SIGXFSZ, SIG_IGN);
      _exit(body());
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  std::string dir_;
};

TEST_F(DaemonFilesTest, AFailedWriteLeavesTheOldContentsAndNoDebris) {
  const std::string path = dir_ + "/state";
  ASSERT_TRUE(WriteFileAtomically(path, "first\n", 0644).ok());
  EXPECT_EQ(OnAFullFileSystem([&] { return WriteFileAtomically(path, "second\n", 0644).ok(); }), 0);
  EXPECT_EQ(Read(path), "first\n");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 1);
  ASSERT_TRUE(WriteFileAtomically(path, "second\n", 0600).ok());
  EXPECT_EQ(Read(path), "second\n");
  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

// The instance id was written in place: on a full file system it was left empty, and every later
// start was refused. Now the start that cannot record it fails and leaves nothing; the next one
// records it.
TEST_F(DaemonFilesTest, AnInstanceIdThatCannotBeRecordedFailsThatStartOnly) {
  EXPECT_EQ(OnAFullFileSystem([&] {
              absl::StatusOr<InstanceId> id = LoadOrCreateInstanceId(dir_);
              return !id.ok() && id.status().message().find("recording the instance id") !=
                                     absl::string_view::npos
                         ? 0
                         : 1;
            }),
            0);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/instance_id"));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 0);
  absl::StatusOr<InstanceId> id = LoadOrCreateInstanceId(dir_);
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<InstanceId> again = LoadOrCreateInstanceId(dir_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*id, *again);
}

TEST_F(DaemonFilesTest, ADirectoryIsCreatedWithItsModeAndCheckedForWriters) {
  const mode_t old = umask(0);
  const std::string created = dir_ + "/a/b";
  absl::Status made = PrepareDirectory(created, 0750, "daemon.state_dir");
  umask(old);
  ASSERT_TRUE(made.ok()) << made;
  struct stat st {};
  ASSERT_EQ(stat(created.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0750u);
  chmod(created.c_str(), 0770);
  absl::Status writable = PrepareDirectory(created, 0750, "daemon.state_dir");
  EXPECT_TRUE(absl::IsFailedPrecondition(writable)) << writable;
  EXPECT_NE(writable.message().find("daemon.state_dir: '" + created + "' (mode 0770)"),
            std::string::npos)
      << writable;
  std::ofstream(dir_ + "/file") << "x";
  EXPECT_FALSE(PrepareDirectory(dir_ + "/file", 0750, "daemon.state_dir").ok());
}

TEST_F(DaemonFilesTest, ALockedDirectoryNamesItsHolder) {
  absl::StatusOr<UniqueFd> held = LockDirectory(dir_, "daemon.state_dir");
  ASSERT_TRUE(held.ok()) << held.status();
  // A second open file (as a second daemon would have) cannot take it.
  absl::StatusOr<UniqueFd> second = LockDirectory(dir_, "daemon.state_dir");
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("in use by another tierd (pid " +
                                           std::to_string(getpid()) + ")"),
            std::string::npos)
      << second.status();
  held->Reset();
  EXPECT_TRUE(LockDirectory(dir_, "daemon.state_dir").ok());
}

}  // namespace
}  // namespace tierd::daemon
