// Unix-domain socket helpers: bind/listen, connect, and messages with file descriptors attached
// (SCM_RIGHTS).
#pragma once

#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace tierd {

// Binds a SOCK_SEQPACKET listener at `path` with the given file mode. A stale socket file left by
// a dead daemon is replaced; a live one is an error (another daemon serves it). The listener is
// non-blocking, for an event loop.
absl::StatusOr<UniqueFd> ListenSeqpacket(const std::string& path, unsigned mode);

absl::StatusOr<UniqueFd> ConnectSeqpacket(const std::string& path);

// Sends one packet with `fds` attached.
absl::Status SendWithFds(int sock, const void* data, size_t size, std::span<const int> fds);

// Receives one packet into `data` (at most `capacity` bytes) and the fds attached to it, which the
// caller then owns. Returns the packet's length; 0 means the peer closed the socket.
absl::StatusOr<size_t> ReceiveWithFds(int sock, void* data, size_t capacity,
                                      std::vector<UniqueFd>* fds);

}  // namespace tierd
