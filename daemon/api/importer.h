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
// per session, so that the broker's loop never waits for a disk. The broker tells the importer
// before a session ends: its queued import is dropped and its running one stopped, so nothing
// writes into a chunk that the session's end frees.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
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

struct ImporterOptions {
  uint32_t queue_depth = 16;
  uint64_t io_size = 1 << 20;
  IoBackendKind backend = IoBackendKind::kAuto;
  // Tests: called once the ranges are read, before the file is checked again.
  std::function<void(const ImportJob&)> after_read;
  // Tests: called once the checks passed, before the read.
  std::function<void(const ImportJob&)> before_read;
  // Tests: called when EndSession has stopped a running import and waits for it.
  std::function<void()> stopping;
};

class Importer {
 public:
  Importer(ChunkService* chunks, ImporterOptions options = {});
  // Drops the queued imports (each replied CANCELLED) and waits for the running one.
  ~Importer();
  Importer(const Importer&) = delete;
  Importer& operator=(const Importer&) = delete;

  // Queues the import; its reply (ImportReply) is sent on job.reply_to when it ends.
  // RESOURCE_EXHAUSTED, and nothing queued, when the session has one queued or running.
  absl::Status Submit(ImportJob job);
  // The session is ending: its queued import is dropped and its running one stopped (replied
  // CANCELLED); returns once neither touches its chunk.
  void EndSession(SessionId id);

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

  absl::Mutex mu_;
  std::deque<ImportJob> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<SessionId> busy_ ABSL_GUARDED_BY(mu_);  // queued or running
  SessionId running_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> cancel_running_{false};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tierd::daemon
