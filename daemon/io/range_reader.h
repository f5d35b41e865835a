// Reads byte ranges of one file into memory through an IoBackend (io_uring, or its thread-pool
// stand-in): for imports, where a client's checkpoint goes straight into its chunks. Each range is
// read in pieces of at most io_size bytes, queue_depth of them in flight; a short transfer goes on
// where it stopped, and a read that finds the end of the file before the range's end is an error.
//
// With O_DIRECT the file's offsets, lengths and buffers must be aligned, and a checkpoint's
// tensors are not: each piece is read whole blocks at a time into an aligned buffer of the
// reader's own and copied from there, so the page cache is not filled. Buffered, pieces are read
// straight into their destinations.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "daemon/io/io_backend.h"

namespace tierd::daemon {

struct ReadRange {
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  char* dst = nullptr;
};

struct RangeReaderOptions {
  uint32_t queue_depth = 8;
  uint64_t io_size = 1 << 20;  // the largest piece
  // The file is open with O_DIRECT: blocks of this size (a power of two) are read through the
  // reader's buffers. 0: buffered.
  uint32_t direct_alignment = 0;
};

class RangeReader {
 public:
  explicit RangeReader(RangeReaderOptions options);
  ~RangeReader();
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;

  // Reads every range from file 0 of `backend` (queue_depth() at least the reader's), pieces in
  // order. The first error names the file, the offset and the cause; on an error, or once
  // `cancel` is set, no piece starts, those in flight are waited for, and the status is returned
  // (CANCELLED for `cancel`). The destinations then hold part of what was read. Returns the bytes
  // read into destinations in `*bytes`.
  // `file_name` names the file in errors.
  absl::Status Read(IoBackend& backend, std::span<const ReadRange> ranges,
                    const std::atomic<bool>& cancel, uint64_t* bytes,
                    absl::string_view file_name = "the file");

 private:
  struct Slot;
  const RangeReaderOptions options_;
  char* buffers_ = nullptr;  // direct: queue_depth aligned buffers
  uint64_t buffer_bytes_ = 0;
};

}  // namespace tierd::daemon
