#include "daemon/api/importer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/unix_socket.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

constexpr uint32_t kDirectAlignment = 4096;

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// What the daemon calls the client's file in messages: its path where the kernel says it.
std::string FileName(int fd) {
  char link[64];
  char path[512];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, path, sizeof(path) - 1);
  if (n <= 0) return "the client's file";
  return std::string(path, static_cast<size_t>(n));
}

}  // namespace

Importer::Importer(ChunkService* chunks, ImporterOptions options)
    : chunks_(chunks),
      options_(std::move(options)),
      direct_reader_(RangeReaderOptions{.queue_depth = options_.queue_depth,
                                        .io_size = options_.io_size,
                                        .direct_alignment = kDirectAlignment}),
      buffered_reader_(
          RangeReaderOptions{.queue_depth = options_.queue_depth, .io_size = options_.io_size}) {
  thread_ = std::thread([this] { Loop(); });
}

Importer::~Importer() {
  std::deque<ImportJob> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    dropped.swap(queue_);
    cancel_running_ = true;
  }
  for (ImportJob& job : dropped) {
    Reply(job, ImportOutcome{absl::CancelledError("the daemon is stopping")});
  }
  thread_.join();
}

ImportStats Importer::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

absl::Status Importer::Submit(ImportJob job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the daemon is stopping");
  if (!busy_.insert(job.session->id).second) {
    return absl::ResourceExhaustedError(
        "an import of this session is already under way; one at a time");
  }
  queue_.push_back(std::move(job));
  return absl::OkStatus();
}

void Importer::EndSession(SessionId id, std::function<void()> then) {
  std::optional<ImportJob> dropped;
  bool deferred = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(queue_.begin(), queue_.end(),
                           [id](const ImportJob& job) { return job.session->id == id; });
    if (it != queue_.end()) {
      dropped = std::move(*it);
      queue_.erase(it);
      busy_.erase(id);
      ++stats_.imports[absl::StatusCode::kCancelled];
    }
    if (running_ == id) {
      // The import may be in a read that takes long (a slow or hung file system): the caller
      // does not wait for it; `then` runs once it has let go of the chunk.
      cancel_running_ = true;
      after_running_ = std::move(then);
      deferred = true;
    }
  }
  if (dropped) Reply(*dropped, ImportOutcome{absl::CancelledError("the session ended")});
  if (!deferred && then) then();
}

void Importer::Loop() {
  for (;;) {
    ImportJob job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Importer* i)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return i->stopping_ || !i->queue_.empty(); },
          this));
      if (stopping_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      running_ = job.session->id;
      cancel_running_ = false;
    }
    ImportOutcome outcome = Run(job, cancel_running_);
    if (!outcome.status.ok() && !absl::IsCancelled(outcome.status)) {
      TIERD_LOG_LIMITED(info, "{}: import into chunk {} failed: {}", job.session->Describe(),
                        job.chunk, outcome.status.message());
    }
    std::function<void()> then;
    {
      // Done with the chunk: the session may send its next import as soon as it has the reply.
      absl::MutexLock lock(&mu_);
      busy_.erase(job.session->id);
      running_ = 0;
      then = std::move(after_running_);
      after_running_ = nullptr;
      ++stats_.imports[outcome.status.code()];
      (outcome.direct ? stats_.bytes_direct : stats_.bytes_buffered) += outcome.bytes;
    }
    Reply(job, outcome);
    if (then) then();  // its session ended meanwhile
  }
}

void Importer::Reply(const ImportJob& job, const ImportOutcome& outcome) {
  ImportReply reply{};
  reply.header = MakeHeader(SessionMessageType::kImportReply);
  reply.status_code = static_cast<int32_t>(outcome.status.code());
  reply.direct = outcome.direct ? 1 : 0;
  reply.bytes = outcome.bytes;
  CopyText(reply.message, outcome.status.message());
  // A client that stopped reading its socket loses its reply, nothing else.
  if (job.reply_to) (void)SendWithFds(job.reply_to.get(), &reply, sizeof(reply), {});
}

absl::Status Importer::CheckFile(const ImportJob& job) {
  const int fd = job.file.get();
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return absl::ErrnoToStatus(errno, "import: the file's fd");
  if ((flags & O_PATH) != 0 || (flags & O_ACCMODE) == O_WRONLY) {
    return absl::InvalidArgumentError("import: the file is not open for reading");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return absl::ErrnoToStatus(errno, "import: fstat");
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError("import: not a regular file");
  if (static_cast<uint64_t>(st.st_size) != job.file_size || MtimeNs(st) != job.file_mtime_ns) {
    return absl::FailedPreconditionError(
        absl::StrCat("import: ", FileName(fd), " changed since its layout was read (", st.st_size,
                     " bytes now, ", job.file_size, " then; or modified since)"));
  }
  if (job.ranges.empty() || job.ranges.size() > kMaxImportRanges) {
    return absl::InvalidArgumentError(
        absl::StrCat("import: 1 to ", kMaxImportRanges, " ranges, not ", job.ranges.size()));
  }
  for (size_t i = 0; i < job.ranges.size(); ++i) {
    const ImportRange& r = job.ranges[i];
    if (r.length == 0 || r.file_offset > job.file_size ||
        r.length > job.file_size - r.file_offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("import: range #", i, " (", r.length, " bytes from byte ", r.file_offset,
                       ") is empty or not inside the file (", job.file_size, " bytes)"));
    }
  }
  return absl::OkStatus();
}

ImportOutcome Importer::Run(ImportJob& job, const std::atomic<bool>& cancel) {
  ImportOutcome outcome;
  if (outcome.status = CheckFile(job); !outcome.status.ok()) return outcome;
  absl::StatusOr<std::span<char>> chunk = chunks_->BeginImport(*job.session, job.chunk);
  if (!chunk.ok()) {
    outcome.status = chunk.status();
    return outcome;
  }
  // The ranges inside the chunk, none overlapping another.
  std::vector<const ImportRange*> by_place;
  for (const ImportRange& r : job.ranges) by_place.push_back(&r);
  std::sort(by_place.begin(), by_place.end(), [](const ImportRange* a, const ImportRange* b) {
    return a->chunk_offset < b->chunk_offset;
  });
  uint64_t end = 0;
  for (const ImportRange* r : by_place) {
    if (r->chunk_offset > chunk->size() || r->length > chunk->size() - r->chunk_offset) {
      outcome.status = absl::InvalidArgumentError(
          absl::StrCat("import: a range of ", r->length, " bytes at byte ", r->chunk_offset,
                       " of chunk ", job.chunk, " is not inside it (", chunk->size(), " bytes)"));
      break;
    }
    if (r->chunk_offset < end) {
      outcome.status = absl::InvalidArgumentError(absl::StrCat(
          "import: ranges overlap in chunk ", job.chunk, " at byte ", r->chunk_offset));
      break;
    }
    end = r->chunk_offset + r->length;
  }
  if (outcome.status.ok()) {
    if (options_.before_read) options_.before_read(job);
    outcome.status = Read(job, *chunk, cancel, &outcome);
  }
  if (outcome.status.ok()) {
    if (options_.after_read) options_.after_read(job);
    struct stat st {};
    if (fstat(job.file.get(), &st) != 0) {
      outcome.status = absl::ErrnoToStatus(errno, "import: fstat");
    } else if (static_cast<uint64_t>(st.st_size) != job.file_size ||
               MtimeNs(st) != job.file_mtime_ns) {
      outcome.status = absl::AbortedError(
          absl::StrCat("import: ", FileName(job.file.get()),
                       " changed while it was read; the chunk does not hold what it holds"));
    }
  }
  chunks_->EndImport(*job.session, job.chunk);
  return outcome;
}

absl::Status Importer::Read(const ImportJob& job, std::span<char> chunk,
                            const std::atomic<bool>& cancel, ImportOutcome* outcome) {
  std::vector<ReadRange> ranges;
  ranges.reserve(job.ranges.size());
  for (const ImportRange& r : job.ranges) {
    ranges.push_back(ReadRange{r.file_offset, r.length, chunk.data() + r.chunk_offset});
  }
  const std::string name = FileName(job.file.get());
  // O_DIRECT through a file description of the daemon's own: setting it on the client's would
  // change the client's reads. The client could read the file (CheckFile), so opening the same
  // file for reading gives it nothing more; it must be the same file.
  char link[64];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", job.file.get());
  UniqueFd direct(open(link, O_RDONLY | O_DIRECT | O_CLOEXEC));
  if (direct) {
    struct stat a {
    }, b{};
    if (fstat(direct.get(), &a) != 0 || fstat(job.file.get(), &b) != 0 || a.st_dev != b.st_dev ||
        a.st_ino != b.st_ino) {
      direct.Reset();
    }
  }
  for (const bool use_direct : {true, false}) {
    if (use_direct && !direct) continue;
    const int fds[] = {use_direct ? direct.get() : job.file.get()};
    std::unique_ptr<IoBackend> backend;
    if (options_.backend != IoBackendKind::kThreads) {
      absl::StatusOr<std::unique_ptr<IoBackend>> uring = MakeUringBackend(
          fds, UringOptions{.queue_depth = options_.queue_depth, .max_buffers = 1});
      if (uring.ok()) {
        backend = std::move(*uring);
      } else if (options_.backend == IoBackendKind::kUring) {
        return uring.status();
      }
    }
    if (backend == nullptr) backend = MakeThreadPoolBackend(fds, options_.queue_depth, 2);
    RangeReader& reader = use_direct ? direct_reader_ : buffered_reader_;
    absl::Status s = reader.Read(*backend, ranges, cancel, &outcome->bytes, name);
    // A file system that takes O_DIRECT at open and refuses it at the read: buffered instead.
    if (use_direct && absl::IsInvalidArgument(s)) continue;
    outcome->direct = use_direct;
    return s;
  }
  return absl::InternalError("import: no way to read the file");
}

}  // namespace tierd::daemon
