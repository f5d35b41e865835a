#include "daemon/io/io_engine.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace tierd::daemon {

struct IoEngine::Job {
  std::vector<IoSpan> spans;
  Callback done;
  IoOrder order;
  absl::Time due;  // the deadline, or the submission time plus max_wait when that is sooner
  uint64_t seq = 0;
  size_t next_span = 0;      // first span not fully issued
  uint64_t next_offset = 0;  // bytes of spans[next_span] already issued
  size_t in_flight = 0;
  bool queued = true;   // still in the issue queue
  absl::Status status;  // first error

  bool issued() const { return next_span >= spans.size(); }
};

// The jobs with sub-I/Os left to issue, by flow (engine thread only). Each flow's service is
// counted in bytes over its weight; the flow with the least goes next, and a flow that was idle
// starts level with the others (no credit for the time it asked for nothing).
class IoEngine::IssueQueue {
 public:
  void Add(Job* job) {
    auto [it, fresh] = flows_.try_emplace(job->order.flow);
    Flow& f = it->second;
    if (fresh) f.served = virtual_now_;
    f.weight = std::max<uint32_t>(1, job->order.weight);
    f.jobs.insert(job);
  }
  // The next job to issue from, or null: the least served flow's most urgent job.
  Job* Next() {
    Flow* best = nullptr;
    for (auto& [id, f] : flows_) {
      if (best == nullptr || f.served < best->served ||
          (f.served == best->served && Urgent()(*f.jobs.begin(), *best->jobs.begin()))) {
        best = &f;
      }
    }
    if (best == nullptr) return nullptr;
    virtual_now_ = best->served;
    return *best->jobs.begin();
  }
  void Charge(const Job* job, uint64_t bytes) {
    Flow& f = flows_.at(job->order.flow);
    f.served += static_cast<double>(bytes) / f.weight;
  }
  void Remove(Job* job) {
    auto it = flows_.find(job->order.flow);
    if (it == flows_.end()) return;
    it->second.jobs.erase(job);
    if (it->second.jobs.empty()) flows_.erase(it);
  }
  bool empty() const { return flows_.empty(); }

 private:
  struct Urgent {
    bool operator()(const Job* a, const Job* b) const {
      return a->due != b->due ? a->due < b->due : a->seq < b->seq;
    }
  };
  struct Flow {
    std::set<Job*, Urgent> jobs;
    double served = 0;  // bytes issued over weight, on the virtual clock
    uint32_t weight = 1;
  };
  std::map<uint64_t, Flow> flows_;  // flows with jobs queued; a handful (one per session)
  double virtual_now_ = 0;          // the service of the flow issued from last
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

void IoEngine::Run(std::vector<IoSpan> spans, Callback done, IoOrder order) {
  auto job = std::make_unique<Job>();
  job->spans = std::move(spans);
  job->done = std::move(done);
  job->order = order;
  job->due = std::min(order.deadline, absl::Now() + options_.max_wait);
  {
    absl::MutexLock lock(&mu_);
    job->seq = submitted_++;
    incoming_.push_back(std::move(job));
  }
  backend_->Wake();
}

absl::Status IoEngine::RunAndWait(std::vector<IoSpan> spans, IoOrder order) {
  absl::Notification done;
  absl::Status status;
  Run(
      std::move(spans),
      [&](absl::Status s) {
        status = std::move(s);
        done.Notify();
      },
      order);
  done.WaitForNotification();
  return status;
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
  IoEngineStats out = stats_;
  out.in_flight = in_flight_.load(std::memory_order_relaxed);
  out.jobs_queued = submitted_ - finished_;
  return out;
}

void IoEngine::CountBytes(const IoRequest& r, uint64_t n) {
  std::vector<uint64_t>& by_file =
      r.kind == IoKind::kRead ? stats_.file_bytes_read : stats_.file_bytes_written;
  if (by_file.size() <= r.file) by_file.resize(r.file + 1);
  by_file[r.file] += n;
  (r.kind == IoKind::kRead ? stats_.bytes_read : stats_.bytes_written) += n;
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
  // Jobs with sub-I/Os left to issue. A job is owned by the engine from Run until its callback has
  // run; it lives here while queued, and in its sub-I/Os' tags while in flight.
  IssueQueue queue;
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
        queue.Add(incoming_.front().release());
        incoming_.pop_front();
      }
      stopping = stopping_;
    }
    if (stopping && queue.empty() && in_flight == 0 && retry.empty()) return;

    // Fill the queue: continuations first, then new sub-I/Os, each from the job that goes next.
    batch.clear();
    while (in_flight + batch.size() < depth && !retry.empty()) {
      batch.push_back(retry.front()->request);
      retry.pop_front();
    }
    while (in_flight + batch.size() < depth) {
      Job* job = queue.Next();
      if (job == nullptr) break;
      if (job->issued() || !job->status.ok()) {
        queue.Remove(job);
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
      constexpr uint64_t kSyncCost = 4096;  // a sync moves no bytes but takes its turn
      queue.Charge(job, n == 0 ? kSyncCost : n);
      if (job->issued()) {
        queue.Remove(job);
        job->queued = false;
      }
    }
    if (!batch.empty()) {
      in_flight += batch.size();
      in_flight_.store(in_flight, std::memory_order_relaxed);
      absl::Status s = backend_->Submit(batch);
      if (!s.ok()) {
        // The ring refused the batch: fail each request as an I/O error would.
        in_flight -= batch.size();
        for (const IoRequest& r : batch) {
          Complete(reinterpret_cast<SubIo*>(r.tag), -EIO, queue);
        }
      }
    }
    if (in_flight == 0 && retry.empty()) {
      if (!queue.empty()) continue;  // failed jobs left to finish
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
    in_flight_.store(in_flight - n, std::memory_order_relaxed);
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
          CountBytes(r, result);
        }
        sub->request.offset += result;
        sub->request.buffer += result;
        sub->request.length -= result;
        retry.push_back(sub);
        continue;
      }
      // Nothing moved where bytes were expected: the end of the file, nothing more will come.
      Complete(sub, result == 0 && r.kind != IoKind::kSync && r.length > 0 ? -ENODATA : result,
               queue);
    }
  }
}

void IoEngine::Complete(SubIo* sub, int32_t result, IssueQueue& queue) {
  std::unique_ptr<SubIo> owned(sub);
  Job* job = sub->job;
  --job->in_flight;
  {
    absl::MutexLock lock(&mu_);
    if (result < 0) {
      ++stats_.errors;
      if (job->status.ok()) job->status = absl::ErrnoToStatus(-result, Describe(sub->request));
    } else if (sub->request.kind != IoKind::kSync) {
      CountBytes(sub->request, result);
    }
  }
  if (!job->status.ok() && job->queued) {  // a failed job issues nothing more
    queue.Remove(job);
    job->queued = false;
  }
  if (!job->queued && job->in_flight == 0) Finish(job);
}

void IoEngine::Finish(Job* job) {
  std::unique_ptr<Job> owned(job);
  if (job->done) job->done(job->status);
  absl::MutexLock lock(&mu_);
  ++finished_;
}

}  // namespace tierd::daemon
