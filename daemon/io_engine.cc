#include "daemon/io_engine.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierd {

struct IoEngine::Job {
  std::vector<IoSpan> spans;
  Callback done;
  size_t next_span = 0;      // first span not fully issued
  uint64_t next_offset = 0;  // bytes of spans[next_span] already issued
  size_t in_flight = 0;
  bool queued = true;   // still in the issue queue
  absl::Status status;  // first error

  bool issued() const { return next_span >= spans.size(); }
};

IoEngine::IoEngine(std::unique_ptr<IoBackend> backend, IoEngineOptions options)
    : backend_(std::move(backend)), options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
}

IoEngine::~IoEngine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  backend_->Wake();
  thread_.join();
}

void IoEngine::Run(std::vector<IoSpan> spans, Callback done) {
  auto job = std::make_unique<Job>();
  job->spans = std::move(spans);
  job->done = std::move(done);
  {
    absl::MutexLock lock(&mu_);
    incoming_.push_back(std::move(job));
    ++submitted_;
  }
  backend_->Wake();
}

void IoEngine::Drain() {
  absl::MutexLock lock(&mu_);
  std::pair<IoEngine*, uint64_t> arg(this, submitted_);
  mu_.Await(absl::Condition(
      +[](std::pair<IoEngine*, uint64_t>* a)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->first->finished_ >= a->second; },
      &arg));
}

IoEngineStats IoEngine::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::string IoEngine::Describe(const IoRequest& r) const {
  const std::string file = r.file < options_.file_names.size() ? options_.file_names[r.file]
                                                               : absl::StrCat("file ", r.file);
  switch (r.kind) {
    case IoKind::kRead:
      return absl::StrCat("read of ", r.length, " bytes at offset ", r.offset, " of ", file);
    case IoKind::kWrite:
      return absl::StrCat("write of ", r.length, " bytes at offset ", r.offset, " of ", file);
    case IoKind::kSync:
      return absl::StrCat("fdatasync of ", file);
  }
  return "I/O";
}

void IoEngine::Loop() {
  // Jobs with sub-I/Os left to issue, oldest first. A job is owned by the engine from Run until
  // its callback has run; it lives here while queued, and in its sub-I/Os' tags while in flight.
  std::deque<Job*> to_issue;
  std::deque<SubIo*> retry;  // continuations of short transfers
  size_t in_flight = 0;
  const uint32_t depth = backend_->queue_depth();
  std::vector<IoCompletion> completions(depth);
  std::vector<IoRequest> batch;

  for (;;) {
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      while (!incoming_.empty()) {
        to_issue.push_back(incoming_.front().release());
        incoming_.pop_front();
      }
      stopping = stopping_;
    }
    if (stopping && to_issue.empty() && in_flight == 0 && retry.empty()) return;

    // Fill the queue: continuations first, then new sub-I/Os in job order. Each step is O(1), so
    // a batch of thousands of chunks costs no more per sub-I/O than a batch of one.
    batch.clear();
    while (in_flight + batch.size() < depth && !retry.empty()) {
      batch.push_back(retry.front()->request);
      retry.pop_front();
    }
    while (in_flight + batch.size() < depth && !to_issue.empty()) {
      Job* job = to_issue.front();
      if (job->issued() || !job->status.ok()) {
        to_issue.pop_front();
        job->queued = false;
        if (job->in_flight == 0) Finish(job);
        continue;
      }
      const IoSpan& span = job->spans[job->next_span];
      const uint64_t left = span.length - job->next_offset;
      const uint64_t n = span.kind == IoKind::kSync ? 0 : std::min(left, options_.io_size);
      auto* sub = new SubIo{job, IoRequest{0, span.kind, span.file, span.offset + job->next_offset,
                                           span.buffer + job->next_offset, static_cast<uint32_t>(n),
                                           span.buffer_index}};
      sub->request.tag = reinterpret_cast<uint64_t>(sub);
      job->next_offset += n;
      if (job->next_offset >= span.length) {
        ++job->next_span;
        job->next_offset = 0;
      }
      ++job->in_flight;
      batch.push_back(sub->request);
    }
    if (!batch.empty()) {
      in_flight += batch.size();
      absl::Status s = backend_->Submit(batch);
      if (!s.ok()) {
        // The ring refused the batch: fail each request as an I/O error would.
        in_flight -= batch.size();
        for (const IoRequest& r : batch) Complete(reinterpret_cast<SubIo*>(r.tag), -EIO);
      }
    }
    if (in_flight == 0 && retry.empty()) {
      if (!to_issue.empty()) continue;  // finished jobs left at the front
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](IoEngine* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return !e->incoming_.empty() || e->stopping_;
                               },
                               this),
                           absl::Seconds(1));
      continue;
    }
    const size_t n = backend_->Reap(completions, absl::Milliseconds(100));
    for (size_t i = 0; i < n; ++i) {
      --in_flight;
      auto* sub = reinterpret_cast<SubIo*>(completions[i].tag);
      const int32_t result = completions[i].result;
      const IoRequest& r = sub->request;
      if (result > 0 && r.kind != IoKind::kSync && static_cast<uint32_t>(result) < r.length) {
        // Short transfer: continue from where it stopped.
        {
          absl::MutexLock lock(&mu_);
          ++stats_.short_transfers;
          (r.kind == IoKind::kRead ? stats_.bytes_read : stats_.bytes_written) += result;
        }
        sub->request.offset += result;
        sub->request.buffer += result;
        sub->request.length -= result;
        retry.push_back(sub);
        continue;
      }
      // Nothing moved where bytes were expected: the end of the file, nothing more will come.
      Complete(sub, result == 0 && r.kind != IoKind::kSync && r.length > 0 ? -ENODATA : result);
    }
  }
}

void IoEngine::Complete(SubIo* sub, int32_t result) {
  std::unique_ptr<SubIo> owned(sub);
  Job* job = sub->job;
  --job->in_flight;
  {
    absl::MutexLock lock(&mu_);
    if (result < 0) {
      ++stats_.errors;
      if (job->status.ok()) job->status = absl::ErrnoToStatus(-result, Describe(sub->request));
    } else if (sub->request.kind == IoKind::kRead) {
      stats_.bytes_read += result;
    } else if (sub->request.kind == IoKind::kWrite) {
      stats_.bytes_written += result;
    }
  }
  if (!job->queued && job->in_flight == 0) Finish(job);
}

void IoEngine::Finish(Job* job) {
  std::unique_ptr<Job> owned(job);
  if (job->done) job->done(job->status);
  absl::MutexLock lock(&mu_);
  ++finished_;
}

}  // namespace tierd
