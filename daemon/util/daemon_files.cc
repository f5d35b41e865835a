#include "daemon/util/daemon_files.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tierd::daemon {
namespace {

absl::Status Errno(absl::string_view what) { return absl::ErrnoToStatus(errno, what); }

std::string Octal(mode_t mode) { return absl::StrFormat("%04o", mode & 07777); }

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    const ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("write to '", path, "'"));
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& dir) {
  UniqueFd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd) return Errno(absl::StrCat("open('", dir, "')"));
  if (fsync(fd.get()) != 0) return Errno(absl::StrCat("fsync('", dir, "')"));
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareDirectory(const std::string& path, mode_t mode, absl::string_view what) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) return Errno(absl::StrCat(what, ": stat('", path, "')"));
    std::error_code ec;
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": cannot create '", parent.string(), "': ", ec.message()));
    }
    if (mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
      return Errno(absl::StrCat(what, ": mkdir('", path, "')"));
    }
    // Its mode is set through the directory itself, whatever the umask, and never by name once it
    // could be someone else's.
    UniqueFd fd(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) return Errno(absl::StrCat(what, ": open('", path, "')"));
    if (fstat(fd.get(), &st) != 0) return Errno(absl::StrCat(what, ": fstat('", path, "')"));
    if (st.st_uid == geteuid() && fchmod(fd.get(), mode) != 0) {
      return Errno(absl::StrCat(what, ": chmod('", path, "')"));
    }
    if (stat(path.c_str(), &st) != 0) return Errno(absl::StrCat(what, ": stat('", path, "')"));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": '", path, "' exists and is not a directory"));
  }
  if (st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": '", path, "' belongs to uid ", st.st_uid,
                     ", not to the daemon's user (uid ", geteuid(),
                     "); whoever owns it can replace the daemon's files. chown it to the daemon's "
                     "user, or name a directory of the daemon's own"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": '", path, "' (mode ", Octal(st.st_mode), ") is writable by ",
                     (st.st_mode & S_IWOTH) != 0 ? "everyone" : "its group",
                     "; anyone who can write there can replace the daemon's files. chmod go-w '",
                     path, "', or name a directory of the daemon's own"));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> LockDirectory(const std::string& dir, absl::string_view what) {
  const std::string path = dir + "/tierd.lock";
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd) return Errno(absl::StrCat(what, ": open('", path, "')"));
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return Errno(absl::StrCat(what, ": flock('", path, "')"));
    char text[32] = {};
    const ssize_t n = pread(fd.get(), text, sizeof(text) - 1, 0);
    int64_t pid = 0;
    const bool known =
        n > 0 && absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(text, n)), &pid);
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": '", dir, "' is in use by another tierd",
        known ? absl::StrCat(" (pid ", pid, ")") : std::string(),
        "; two daemons on one directory would destroy each other's data. Stop that one, or "
        "give this one directories of its own"));
  }
  // The pid only makes the refusal message of a second daemon more helpful; the lock is what
  // matters, so a file system that refuses the write refuses nothing here.
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd.get(), 0) == 0) (void)!pwrite(fd.get(), pid.data(), pid.size(), 0);
  return fd;
}

absl::Status PublishSocket(const std::string& dir, const std::string& name, mode_t mode,
                           std::optional<gid_t> gid,
                           const std::function<absl::Status(const std::string& path)>& bind) {
  std::string staging = dir + "/.b-XXXXXX";
  if (mkdtemp(staging.data()) == nullptr) {
    return Errno(absl::StrCat("mkdtemp('", staging, "')"));
  }
  const std::string staged = staging + "/" + name;
  const std::string path = dir + "/" + name;
  absl::Status status = bind(staged);
  // The staging directory is the daemon's alone (0700), so these names cannot have been swapped.
  if (status.ok() && chmod(staged.c_str(), mode) != 0) {
    status = Errno(absl::StrCat("chmod('", staged, "')"));
  }
  if (status.ok() && gid.has_value() &&
      fchownat(AT_FDCWD, staged.c_str(), static_cast<uid_t>(-1), *gid, AT_SYMLINK_NOFOLLOW) != 0) {
    status = Errno(absl::StrCat("chown('", staged, "', gid ", *gid, ")"));
  }
  if (status.ok() && rename(staged.c_str(), path.c_str()) != 0) {
    status = Errno(absl::StrCat("rename('", staged, "', '", path, "')"));
  }
  unlink(staged.c_str());
  rmdir(staging.c_str());
  return status;
}

absl::StatusOr<gid_t> ResolveGroup(const std::string& group) {
  if (uint32_t numeric; absl::SimpleAtoi(group, &numeric)) return static_cast<gid_t>(numeric);
  if (struct group* g = getgrnam(group.c_str()); g != nullptr) return g->gr_gid;
  return absl::NotFoundError(
      absl::StrCat("socket_group '", group, "' does not exist (give a group name or a gid)"));
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode) {
  std::string tmp = path + ".XXXXXX";
  UniqueFd fd(mkostemp(tmp.data(), O_CLOEXEC));
  if (!fd) return Errno(absl::StrCat("creating a file beside '", path, "'"));
  absl::Status status;
  if (fchmod(fd.get(), mode) != 0) status = Errno(absl::StrCat("chmod('", tmp, "')"));
  if (status.ok()) status = WriteAll(fd.get(), contents, tmp);
  if (status.ok() && fsync(fd.get()) != 0) status = Errno(absl::StrCat("fsync('", tmp, "')"));
  fd.Reset();
  if (status.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    status = Errno(absl::StrCat("rename('", tmp, "', '", path, "')"));
  }
  if (!status.ok()) {
    unlink(tmp.c_str());
    return status;
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir);
}

}  // namespace tierd::daemon
