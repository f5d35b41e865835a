// Imports for the session socket: the daemon reads byte ranges of a client's file (a checkpoint;
// the client passes its fd, never a path) straight into a chunk the session holds acquired for
// writing in the host tier, with io_uring and O_DIRECT where the file system allows it, so the
// training process neither reads nor caches the bytes. Protocol: common/session_protocol.h.
//
// Everything the client sends is checked before a byte is read: the fd is a regular file open for
// reading; its size and modification time are what the client saw when it read the file's layout;
// the ranges lie in the file and the chunk and do not overlap in the chunk. After the read the
// file is checked again: one that changed meanwhile makes the import fail, as does a read that
// finds the end of the file early. A failed import leaves nothing behind (the fd is closed, the
// pin dropped); the chunk's bytes are then the client's to write again.
//
// Imports run on a thread of their own, one at a time and in the order they came, at most one
// per session, so that the broker's loop never waits for a disk. The broker hands a session's end
// to the importer: its queued import is dropped, its running one stopped, and the session's
// chunks are freed only once nothing writes into them (without the broker waiting for a read).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/session_protocol.h"
#include "common/unique_fd.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/io/io_backend.h"
#include "daemon/io/range_reader.h"

namespace tierd::daemon {

struct ImportJob {
  std::shared_ptr<Session> session;
  ChunkId chunk = 0;
  UniqueFd file;
  uint64_t file_size = 0;  // as the client saw it
  int64_t file_mtime_ns = 0;
  std::vector<ImportRange> ranges;
  UniqueFd reply_to;  // the session's connection (a duplicate): the reply goes there
};

struct ImportOutcome {
  absl::Status status;
  uint64_t bytes = 0;
  bool direct = false;
};

// What the importer has done since it started (the metrics endpoint's tierd_imports_total and
// tierd_import_bytes_total).
struct ImportStats {
  std::map<absl::StatusCode, uint64_t> imports;  // ended, by outcome
  uint64_t bytes_direct = 0;                     // read with O_DIRECT
  uint64_t bytes_buffered = 0;
};

struct ImporterOptions {
  uint32_t queue_depth = 16;
  uint64_t io_size = 1 << 20;
  IoBackendKind backend = IoBackendKind::kAuto;
  // Tests: called once the ranges are read, before the file is checked again.
  std::function<void(const ImportJob&)> after_read;
  // Tests: called once the checks passed, before the read.
  std::function<void(const ImportJob&)> before_read;
};

class Importer {
 public:
  Importer(ChunkService* chunks, ImporterOptions options = {});
  // Drops the queued imports (each replied CANCELLED) and waits for the running one (and the end
  // of its session, if EndSession deferred one).
  ~Importer();
  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;

  // Queues the import; its reply (ImportReply) is sent on job.reply_to when it ends.
  // RESOURCE_EXHAUSTED, and nothing queued, when the session has one queued or running.
  absl::Status Submit(ImportJob job);
  // The session is ending: its queued import is dropped (replied CANCELLED) and its running one
  // told to stop; `then` (the session's end: freeing its chunks) runs once no import touches
  // them: at once, or on the importer's thread when the running import has stopped. Never waits
  // for a read.
  void EndSession(SessionId id, std::function<void()> then);
  ImportStats stats() const;

  // One import, on the caller's thread (Submit's thread runs these); public for tests.
  ImportOutcome Run(ImportJob& job, const std::atomic<bool>& cancel);

 private:
  void Loop();
  static void Reply(const ImportJob& job, const ImportOutcome& outcome);
  // The checks on the fd and on the ranges against the file (before the chunk is touched).
  static absl::Status CheckFile(const ImportJob& job);
  // Reads the ranges into the chunk's memory, with O_DIRECT when the file system allows.
  absl::Status Read(const ImportJob& job, std::span<char> chunk, const std::atomic<bool>& cancel,
                    ImportOutcome* outcome);

  ChunkService* const chunks_;
  const ImporterOptions options_;
  RangeReader direct_reader_;    // its aligned buffers are allocated once
  RangeReader buffered_reader_;  // reads straight into the chunk

  mutable absl::Mutex mu_;
  std::deque<ImportJob> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<SessionId> busy_ ABSL_GUARDED_BY(mu_);  // queued or running
  SessionId running_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> after_running_ ABSL_GUARDED_BY(mu_);  // EndSession's, for running_
  std::atomic<bool> cancel_running_{false};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  ImportStats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tierd::daemon
