#include "daemon/io/io_backend.h"

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/unique_fd.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kWakeTag = ~0ull;

class UringBackend final : public IoBackend {
 public:
  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  static absl::StatusOr<std::unique_ptr<IoBackend>> Create(std::span<const int> fds,
                                                           const UringOptions& options) {
    auto b = std::unique_ptr<UringBackend>(new UringBackend());
    b->depth_ = options.queue_depth;
    io_uring_params params{};
    if (options.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = 100;  // ms before the poller sleeps
    }
    // One extra entry for the wake-up poll.
    int rc = io_uring_queue_init_params(options.queue_depth + 1, &b->ring_, &params);
    if (rc < 0) {
      return absl::ErrnoToStatus(
          -rc, absl::StrCat("io_uring_queue_init (depth ", options.queue_depth, ")"));
    }
    b->initialized_ = true;
    if (!fds.empty()) {
      rc = io_uring_register_files(&b->ring_, fds.data(), static_cast<unsigned>(fds.size()));
      if (rc < 0) return absl::ErrnoToStatus(-rc, "io_uring_register_files");
    }
    rc = io_uring_register_buffers_sparse(&b->ring_, options.max_buffers);
    if (rc < 0) return absl::ErrnoToStatus(-rc, "io_uring_register_buffers_sparse");
    b->wake_ = UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!b->wake_) return absl::ErrnoToStatus(errno, "eventfd");
    b->ArmWake();
    return std::unique_ptr<IoBackend>(std::move(b));
  }

  uint32_t queue_depth() const override { return depth_; }

  absl::Status Submit(std::span<const IoRequest> requests) override {
    for (const IoRequest& r : requests) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) return absl::ResourceExhaustedError("io_uring submission queue full");
      switch (r.kind) {
        case IoKind::kRead:
          if (r.buffer_index >= 0) {
            io_uring_prep_read_fixed(sqe, static_cast<int>(r.file), r.buffer, r.length, r.offset,
                                     r.buffer_index);
          } else {
            io_uring_prep_read(sqe, static_cast<int>(r.file), r.buffer, r.length, r.offset);
          }
          break;
        case IoKind::kWrite:
          if (r.buffer_index >= 0) {
            io_uring_prep_write_fixed(sqe, static_cast<int>(r.file), r.buffer, r.length, r.offset,
                                      r.buffer_index);
          } else {
            io_uring_prep_write(sqe, static_cast<int>(r.file), r.buffer, r.length, r.offset);
          }
          break;
        case IoKind::kSync:
          io_uring_prep_fsync(sqe, static_cast<int>(r.file), IORING_FSYNC_DATASYNC);
          break;
      }
      sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, r.tag);
    }
    int rc = io_uring_submit(&ring_);
    if (rc < 0) return absl::ErrnoToStatus(-rc, "io_uring_submit");
    return absl::OkStatus();
  }

  size_t Reap(std::span<IoCompletion> out, absl::Duration timeout) override {
    io_uring_cqe* cqe = nullptr;
    __kernel_timespec ts{};
    ts.tv_sec = absl::ToInt64Seconds(timeout);
    ts.tv_nsec = absl::ToInt64Nanoseconds(timeout - absl::Seconds(ts.tv_sec));
    int rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    if (rc < 0) return 0;  // timeout or signal
    size_t n = 0;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        uint64_t value;
        [[maybe_unused]] ssize_t r = read(wake_.get(), &value, sizeof(value));
        if (!(cqe->flags & IORING_CQE_F_MORE)) wake_armed_ = false;
        continue;
      }
      if (n == out.size()) {
        --seen;  // leave it for the next Reap
        break;
      }
      out[n++] = IoCompletion{tag, cqe->res};
    }
    io_uring_cq_advance(&ring_, seen);
    if (!wake_armed_) ArmWake();
    return n;
  }

  void Wake() override {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t r = write(wake_.get(), &one, sizeof(one));
  }

  absl::Status RegisterBuffer(int index, void* base, size_t length) override {
    iovec iov{base, length};
    __u64 tag = 0;
    int rc =
        io_uring_register_buffers_update_tag(&ring_, static_cast<unsigned>(index), &iov, &tag, 1);
    if (rc < 0) {
      return absl::ErrnoToStatus(
          -rc, absl::StrCat("registering I/O buffer ", index, " (", length, " bytes)"));
    }
    return absl::OkStatus();
  }

 private:
  UringBackend() = default;

  void ArmWake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return;  // retried after the next Reap
    io_uring_prep_poll_multishot(sqe, wake_.get(), POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    io_uring_submit(&ring_);
    wake_armed_ = true;
  }

  io_uring ring_{};
  bool initialized_ = false;
  uint32_t depth_ = 0;
  UniqueFd wake_;
  bool wake_armed_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(std::span<const int> fds,
                                                            const UringOptions& options) {
  return UringBackend::Create(fds, options);
}

// --- The thread pool ---

namespace {

class ThreadPoolBackend final : public IoBackend {
 public:
  ThreadPoolBackend(std::span<const int> fds, uint32_t depth, uint32_t threads)
      : fds_(fds.begin(), fds.end()), depth_(depth) {
    for (uint32_t i = 0; i < std::max<uint32_t>(threads, 1); ++i) {
      workers_.emplace_back([this] { Work(); });
    }
  }
  ~ThreadPoolBackend() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

  uint32_t queue_depth() const override { return depth_; }

  absl::Status Submit(std::span<const IoRequest> requests) override {
    absl::MutexLock lock(&mu_);
    for (const IoRequest& r : requests) {
      if (r.file >= fds_.size()) {
        done_.push_back({r.tag, -EBADF});
        continue;
      }
      pending_.push_back(r);
    }
    return absl::OkStatus();
  }

  size_t Reap(std::span<IoCompletion> out, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(
                             +[](ThreadPoolBackend* b) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                               return !b->done_.empty() || b->woken_;
                             },
                             this),
                         timeout);
    woken_ = false;
    size_t n = 0;
    while (n < out.size() && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

  void Wake() override {
    absl::MutexLock lock(&mu_);
    woken_ = true;
  }

  absl::Status RegisterBuffer(int, void*, size_t) override { return absl::OkStatus(); }

 private:
  void Work() {
    for (;;) {
      IoRequest r;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](ThreadPoolBackend* b)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return !b->pending_.empty() || b->stopping_; },
            this));
        if (pending_.empty()) return;  // stopping
        r = pending_.front();
        pending_.pop_front();
      }
      const int fd = fds_[r.file];
      ssize_t n = 0;
      do {
        switch (r.kind) {
          case IoKind::kRead:
            n = pread(fd, r.buffer, r.length, static_cast<off_t>(r.offset));
            break;
          case IoKind::kWrite:
            n = pwrite(fd, r.buffer, r.length, static_cast<off_t>(r.offset));
            break;
          case IoKind::kSync:
            n = fdatasync(fd);
            break;
        }
      } while (n < 0 && errno == EINTR);
      const int32_t result = n < 0 ? -errno : static_cast<int32_t>(n);
      absl::MutexLock lock(&mu_);
      done_.push_back({r.tag, result});
    }
  }

  const std::vector<int> fds_;
  const uint32_t depth_;
  absl::Mutex mu_;
  std::deque<IoRequest> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<IoCompletion> done_ ABSL_GUARDED_BY(mu_);
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // last: they stop before the members they use go
};

}  // namespace

std::unique_ptr<IoBackend> MakeThreadPoolBackend(std::span<const int> fds, uint32_t queue_depth,
                                                 uint32_t threads) {
  return std::make_unique<ThreadPoolBackend>(fds, queue_depth, threads);
}

absl::StatusOr<IoBackendKind> ParseIoBackendKind(absl::string_view text) {
  if (text == "auto") return IoBackendKind::kAuto;
  if (text == "io_uring") return IoBackendKind::kUring;
  if (text == "threads") return IoBackendKind::kThreads;
  return absl::InvalidArgumentError(
      absl::StrCat("the NVMe I/O backend is auto, io_uring or threads, not '", text, "'"));
}

const char* IoBackendName(IoBackendKind kind) {
  switch (kind) {
    case IoBackendKind::kAuto:
      return "auto";
    case IoBackendKind::kUring:
      return "io_uring";
    case IoBackendKind::kThreads:
      return "threads";
  }
  return "?";
}

// --- FaultInjectingBackend ---

struct FaultInjectingBackend::State {
  absl::Mutex mu;
  int fail_count[3] ABSL_GUARDED_BY(mu) = {0, 0, 0};
  int fail_errno[3] ABSL_GUARDED_BY(mu) = {0, 0, 0};
  int short_count[3] ABSL_GUARDED_BY(mu) = {0, 0, 0};
  uint64_t seen[3] ABSL_GUARDED_BY(mu) = {0, 0, 0};
  struct Aimed {
    IoKind kind;
    uint32_t file;
    uint64_t begin, end;
    int err;
  };
  std::vector<Aimed> aimed ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> offsets ABSL_GUARDED_BY(mu);
  absl::Duration delay ABSL_GUARDED_BY(mu);
  // Engine thread only:
  std::deque<IoCompletion> synthesized;
  std::deque<std::pair<absl::Time, IoCompletion>> held;
};

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<IoBackend> inner)
    : inner_(std::move(inner)), state_(std::make_unique<State>()) {}
FaultInjectingBackend::~FaultInjectingBackend() = default;

void FaultInjectingBackend::FailNext(IoKind kind, int err, int count) {
  absl::MutexLock lock(&state_->mu);
  state_->fail_count[static_cast<int>(kind)] = count;
  state_->fail_errno[static_cast<int>(kind)] = err;
}

void FaultInjectingBackend::FailNextIn(IoKind kind, uint32_t file, uint64_t begin, uint64_t end,
                                       int err) {
  absl::MutexLock lock(&state_->mu);
  state_->aimed.push_back({kind, file, begin, end, err});
}

void FaultInjectingBackend::ShortenNext(IoKind kind, int count) {
  absl::MutexLock lock(&state_->mu);
  state_->short_count[static_cast<int>(kind)] = count;
}

void FaultInjectingBackend::SetDelay(absl::Duration delay) {
  absl::MutexLock lock(&state_->mu);
  state_->delay = delay;
}

uint64_t FaultInjectingBackend::seen(IoKind kind) const {
  absl::MutexLock lock(&state_->mu);
  return state_->seen[static_cast<int>(kind)];
}

std::vector<uint64_t> FaultInjectingBackend::submitted_offsets() const {
  absl::MutexLock lock(&state_->mu);
  return state_->offsets;
}

uint32_t FaultInjectingBackend::queue_depth() const { return inner_->queue_depth(); }

absl::Status FaultInjectingBackend::Submit(std::span<const IoRequest> requests) {
  std::vector<IoRequest> pass;
  {
    absl::MutexLock lock(&state_->mu);
    for (IoRequest r : requests) {
      const int k = static_cast<int>(r.kind);
      ++state_->seen[k];
      if (r.kind != IoKind::kSync) state_->offsets.push_back(r.offset);
      auto aimed = std::find_if(state_->aimed.begin(), state_->aimed.end(), [&](const auto& a) {
        return a.kind == r.kind && a.file == r.file && r.offset >= a.begin && r.offset < a.end;
      });
      if (aimed != state_->aimed.end()) {
        state_->synthesized.push_back({r.tag, -aimed->err});
        state_->aimed.erase(aimed);
        continue;
      }
      if (state_->fail_count[k] > 0) {
        --state_->fail_count[k];
        state_->synthesized.push_back({r.tag, -state_->fail_errno[k]});
        continue;
      }
      if (state_->short_count[k] > 0 && r.length > 1) {
        --state_->short_count[k];
        r.length /= 2;
      }
      pass.push_back(r);
    }
  }
  return pass.empty() ? absl::OkStatus() : inner_->Submit(pass);
}

size_t FaultInjectingBackend::Reap(std::span<IoCompletion> out, absl::Duration timeout) {
  absl::Duration delay;
  {
    absl::MutexLock lock(&state_->mu);
    delay = state_->delay;
  }
  size_t n = 0;
  while (n < out.size() && !state_->synthesized.empty()) {
    out[n++] = state_->synthesized.front();
    state_->synthesized.pop_front();
  }
  if (n > 0) return n;
  if (delay == absl::ZeroDuration() && state_->held.empty()) return inner_->Reap(out, timeout);
  // Slow device: hold completions until their time comes.
  std::vector<IoCompletion> fresh(out.size());
  size_t got = inner_->Reap(fresh, state_->held.empty() ? std::min(timeout, absl::Milliseconds(5))
                                                        : absl::Milliseconds(1));
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < got; ++i) state_->held.push_back({now + delay, fresh[i]});
  while (n < out.size() && !state_->held.empty() && state_->held.front().first <= absl::Now()) {
    out[n++] = state_->held.front().second;
    state_->held.pop_front();
  }
  return n;
}

void FaultInjectingBackend::Wake() { inner_->Wake(); }

absl::Status FaultInjectingBackend::RegisterBuffer(int index, void* base, size_t length) {
  return inner_->RegisterBuffer(index, base, length);
}

}  // namespace tierd::daemon
