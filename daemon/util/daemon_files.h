// The daemon's own directories and files — its socket and state directories, their locks, the
// sockets it publishes, and small state files — created with their final modes and never changed
// by name where someone else could have swapped the name for a link.
#pragma once

#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/unique_fd.h"

namespace tierd::daemon {

// Creates the directory `path` (and its parents) when missing, with exactly `mode`, and checks
// that it is a directory owned by the daemon's user and writable by nobody else: a directory
// others can write into lets them replace the daemon's files. `what` names the config key.
// FAILED_PRECONDITION, naming the fix, otherwise.
absl::Status PrepareDirectory(const std::string& path, mode_t mode, absl::string_view what);

// Locks `dir` for this process's life with an exclusive flock on `dir`/tierd.lock (which records
// the holder's pid). FAILED_PRECONDITION, naming the holder, when another process holds it.
absl::StatusOr<UniqueFd> LockDirectory(const std::string& dir, absl::string_view what);

// Publishes a socket at `dir`/`name` with `mode` and, when given, group `gid`, atomically: `bind`
// creates it at a path inside a fresh directory only the daemon can write, where its mode and
// group are set, and it is then renamed into place (replacing a stale socket of a dead daemon).
// Nobody can see the socket with other modes, or make the daemon change some other file.
absl::Status PublishSocket(const std::string& dir, const std::string& name, mode_t mode,
                           std::optional<gid_t> gid,
                           const std::function<absl::Status(const std::string& path)>& bind);

// A group given by name or numeric gid (in containers, /etc/group need not name it).
absl::StatusOr<gid_t> ResolveGroup(const std::string& group);

// Replaces `path` with `contents` atomically and durably (a temporary file written, synced and
// renamed, then the directory synced), created with `mode`. On any error nothing is left behind
// and `path` keeps its old contents.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode);

}  // namespace tierd::daemon
