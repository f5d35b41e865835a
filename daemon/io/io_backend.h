// The seam under the I/O engine: a queue of positional reads, writes and syncs on registered files
// and buffers, completed asynchronously. UringBackend does them with io_uring; tests wrap it in
// FaultInjectingBackend to produce short I/O, errors and slow completions (as LevelDB's Env does).
//
// Submit and Reap are called from one thread (the engine's); Wake from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tierd::daemon {

enum class IoKind : uint8_t { kRead, kWrite, kSync };

struct IoRequest {
  uint64_t tag = 0;  // returned with the completion
  IoKind kind = IoKind::kRead;
  uint32_t file = 0;  // index into the backend's files
  uint64_t offset = 0;
  char* buffer = nullptr;
  uint32_t length = 0;
  int32_t buffer_index = -1;  // registered buffer that contains [buffer, buffer+length), or -1
};

struct IoCompletion {
  uint64_t tag = 0;
  int32_t result = 0;  // bytes transferred, or -errno
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  // The most requests that may be in flight at once.
  virtual uint32_t queue_depth() const = 0;
  // Starts the requests. REQUIRES: in-flight + requests.size() <= queue_depth().
  virtual absl::Status Submit(std::span<const IoRequest> requests) = 0;
  // Waits up to `timeout` for completions (returning early on Wake) and stores up to out.size().
  virtual size_t Reap(std::span<IoCompletion> out, absl::Duration timeout) = 0;
  // Makes a Reap that is waiting return.
  virtual void Wake() = 0;
  // Registers [base, base+length) as buffer `index` (replacing what was there), so that I/O into
  // it needs no page pinning per request.
  virtual absl::Status RegisterBuffer(int index, void* base, size_t length) = 0;
};

struct UringOptions {
  uint32_t queue_depth = 64;
  uint32_t max_buffers = 64;  // registered-buffer slots
  bool sqpoll = false;        // a kernel thread polls the submission queue
};

// io_uring over `fds` (registered as fixed files; the backend does not own them).
absl::StatusOr<std::unique_ptr<IoBackend>> MakeUringBackend(std::span<const int> fds,
                                                            const UringOptions& options);

// The same requests as blocking pread/pwrite/fdatasync calls on `threads` threads of its own: for
// where io_uring is unavailable (a container's seccomp profile, gVisor, an old kernel). Registered
// buffers need no registration here; `queue_depth` requests may be in flight.
std::unique_ptr<IoBackend> MakeThreadPoolBackend(std::span<const int> fds, uint32_t queue_depth,
                                                 uint32_t threads);

// Which backend the NVMe tier uses: io_uring when the kernel lets the daemon have one, else the
// thread pool, saying why (kAuto); or one of them regardless.
enum class IoBackendKind { kAuto, kUring, kThreads };
absl::StatusOr<IoBackendKind> ParseIoBackendKind(absl::string_view text);
const char* IoBackendName(IoBackendKind kind);

// Faults the wrapped backend's requests on command. Thread-safe setters.
class FaultInjectingBackend final : public IoBackend {
 public:
  explicit FaultInjectingBackend(std::unique_ptr<IoBackend> inner);
  ~FaultInjectingBackend() override;

  // The next `count` requests of `kind` fail with -err without reaching the device.
  void FailNext(IoKind kind, int err, int count = 1);
  // The next request of `kind` on `file` that starts in [begin, end) fails with -err: a fault aimed
  // at one area (a region's index, its superblock) whatever else is in flight.
  void FailNextIn(IoKind kind, uint32_t file, uint64_t begin, uint64_t end, int err);
  // The next `count` requests of `kind` move only half their bytes (a short transfer).
  void ShortenNext(IoKind kind, int count = 1);
  // Every completion is held back this long.
  void SetDelay(absl::Duration delay);
  // Requests seen so far, by kind.
  uint64_t seen(IoKind kind) const;
  // The file offset of every read and write submitted so far, in submission order.
  std::vector<uint64_t> submitted_offsets() const;

  uint32_t queue_depth() const override;
  absl::Status Submit(std::span<const IoRequest> requests) override;
  size_t Reap(std::span<IoCompletion> out, absl::Duration timeout) override;
  void Wake() override;
  absl::Status RegisterBuffer(int index, void* base, size_t length) override;

 private:
  struct State;
  std::unique_ptr<IoBackend> inner_;
  std::unique_ptr<State> state_;
};

}  // namespace tierd::daemon
