// The I/O engine: one thread that owns an IoBackend and runs jobs. A job is a list of spans
// (reads, writes, or syncs of whole files); the engine splits spans into sub-I/Os of at most
// io_size bytes, keeps up to queue_depth of them in flight across all jobs, continues short
// transfers where they stopped, checks every completion, and calls the job's callback once, with
// the first error (naming the file, offset and cause) or OK. Callers never block on I/O.
//
// When more sub-I/Os wait than the queue holds, the engine chooses which go next: within a flow
// (one session's I/O) the job with the earliest deadline; between flows, each gets bytes in
// proportion to its weight (start-time fair queueing), so that one session's backlog cannot starve
// another's.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/io/io_backend.h"

namespace tierd::daemon {

struct IoSpan {
  IoKind kind = IoKind::kRead;
  uint32_t file = 0;
  uint64_t offset = 0;
  char* buffer = nullptr;
  uint64_t length = 0;        // 0 for kSync
  int32_t buffer_index = -1;  // registered buffer holding the whole span, or -1
};

// Where a job stands in the queue.
struct IoOrder {
  absl::Time deadline = absl::InfiniteFuture();  // when its bytes are needed
  uint64_t flow = 0;                             // whose I/O it is (a session)
  uint32_t weight = 1;                           // the flow's share against other flows'
};

struct IoEngineOptions {
  uint64_t io_size = 1 << 20;           // largest sub-I/O
  std::vector<std::string> file_names;  // for error messages, by file index
  // A job waits at most this long for jobs with earlier deadlines: its deadline is at most its
  // submission time plus this, so background work (early write-backs) is never starved.
  absl::Duration max_wait = absl::Seconds(1);
};

struct IoEngineStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t short_transfers = 0;
  uint64_t errors = 0;
  std::vector<uint64_t> file_bytes_read, file_bytes_written;  // by file index
  uint32_t in_flight = 0;                                     // sub-I/Os in the ring now
  uint64_t jobs_queued = 0;                                   // jobs submitted and not finished
};

class IoEngine {
 public:
  using Callback = std::function<void(absl::Status)>;

  IoEngine(std::unique_ptr<IoBackend> backend, IoEngineOptions options);
  // Finishes every job already submitted, then stops.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Runs the spans; `done` runs on the engine thread and must not block.
  void Run(std::vector<IoSpan> spans, Callback done, IoOrder order = {});
  // Runs the spans and waits for them: for metadata (superblocks, the index), so that it goes
  // through the same backend, and the same fault injection, as the data. REQUIRES: not on the
  // engine thread (not from a callback).
  absl::Status RunAndWait(std::vector<IoSpan> spans, IoOrder order = {});
  // Waits until every job submitted so far has called back.
  void Drain();

  IoBackend* backend() const { return backend_.get(); }
  uint32_t queue_depth() const { return backend_->queue_depth(); }
  uint64_t io_size() const { return options_.io_size; }
  IoEngineStats stats() const;

 private:
  struct Job;
  class IssueQueue;
  struct SubIo {
    Job* job;
    IoRequest request;
  };

  void Loop();
  void Complete(SubIo* sub, int32_t result, IssueQueue& queue);
  void Finish(Job* job);
  std::string Describe(const IoRequest& r) const;

  std::unique_ptr<IoBackend> backend_;
  const IoEngineOptions options_;

  // Adds a completed transfer's bytes to the totals and its file's.
  void CountBytes(const IoRequest& r, uint64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Job>> incoming_ ABSL_GUARDED_BY(mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;  // also each job's sequence number
  uint64_t finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  IoEngineStats stats_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint32_t> in_flight_{0};

  std::thread thread_;
};

}  // namespace tierd::daemon
