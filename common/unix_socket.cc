#include "common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierd {
namespace {

absl::Status Errno(int err, absl::string_view what) { return absl::ErrnoToStatus(err, what); }

absl::StatusOr<sockaddr_un> MakeAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

}  // namespace

absl::StatusOr<UniqueFd> ListenSeqpacket(const std::string& path, unsigned mode) {
  absl::StatusOr<sockaddr_un> addr = MakeAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return Errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");

  // A socket file that nobody accepts on is a leftover of a daemon that died; one that accepts
  // belongs to a live daemon, which we must not steal from.
  if (absl::StatusOr<UniqueFd> probe = ConnectSeqpacket(path); probe.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("another tierd is already serving '", path, "'"));
  }
  ::unlink(path.c_str());
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(errno, absl::StrCat("bind('", path, "')"));
  }
  if (::chmod(path.c_str(), mode) != 0) return Errno(errno, absl::StrCat("chmod('", path, "')"));
  if (::listen(fd.get(), 128) != 0) return Errno(errno, absl::StrCat("listen('", path, "')"));
  return fd;
}

absl::StatusOr<UniqueFd> ConnectSeqpacket(const std::string& path) {
  absl::StatusOr<sockaddr_un> addr = MakeAddress(path);
  if (!addr.ok()) return addr.status();
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return Errno(errno, "socket(AF_UNIX, SOCK_SEQPACKET)");
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(*addr)) != 0) {
    return Errno(errno, absl::StrCat("connect('", path, "')"));
  }
  return fd;
}

absl::Status SendWithFds(int sock, const void* data, size_t size, std::span<const int> fds) {
  iovec iov{const_cast<void*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      if (static_cast<size_t>(n) != size) {
        return absl::InternalError(absl::StrCat("sendmsg sent ", n, " of ", size, " bytes"));
      }
      return absl::OkStatus();
    }
    if (errno != EINTR) return Errno(errno, "sendmsg on session socket");
  }
}

absl::StatusOr<size_t> ReceiveWithFds(int sock, void* data, size_t capacity,
                                      std::vector<UniqueFd>* fds) {
  iovec iov{data, capacity};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno(errno, "recvmsg on session socket");
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
      if (fds != nullptr) {
        fds->emplace_back(fd);
      } else {
        ::close(fd);
      }
    }
  }
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
    return absl::InvalidArgumentError("session socket message truncated");
  }
  return static_cast<size_t>(n);
}

}  // namespace tierd
