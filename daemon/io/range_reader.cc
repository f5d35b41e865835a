#include "daemon/io/range_reader.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace tierd::daemon {

// One piece in flight: [offset, offset + length) of the file into dst, read as `want` bytes from
// offset - head into `buffer` (direct: the slot's aligned buffer; buffered: dst itself, head 0).
struct RangeReader::Slot {
  uint64_t offset = 0;
  uint64_t length = 0;
  char* dst = nullptr;
  uint64_t head = 0;
  uint64_t want = 0;
  uint64_t got = 0;
  char* buffer = nullptr;
  bool busy = false;
};

RangeReader::RangeReader(RangeReaderOptions options) : options_(options) {
  if (options_.direct_alignment != 0) {
    const uint64_t a = options_.direct_alignment;
    // A piece starts up to a block before its offset and ends up to a block after its end.
    buffer_bytes_ = (options_.io_size + 2 * a + a - 1) / a * a;
    buffers_ = static_cast<char*>(std::aligned_alloc(a, buffer_bytes_ * options_.queue_depth));
  }
}

RangeReader::~RangeReader() { std::free(buffers_); }

absl::Status RangeReader::Read(IoBackend& backend, std::span<const ReadRange> ranges,
                               const std::atomic<bool>& cancel, uint64_t* bytes,
                               absl::string_view file_name) {
  *bytes = 0;
  const uint64_t align = options_.direct_alignment;
  if (align != 0 && buffers_ == nullptr) {
    return absl::ResourceExhaustedError("no memory for the reader's aligned buffers");
  }
  const uint32_t depth = std::min(options_.queue_depth, backend.queue_depth());
  std::vector<Slot> slots(depth);
  for (uint32_t i = 0; i < depth && align != 0; ++i) slots[i].buffer = buffers_ + i * buffer_bytes_;
  size_t range = 0;
  uint64_t done_in_range = 0;  // of ranges[range]
  uint32_t in_flight = 0;
  absl::Status status;

  auto submit = [&](uint32_t i) {
    Slot& s = slots[i];
    IoRequest r;
    r.tag = i;
    r.kind = IoKind::kRead;
    r.file = 0;
    r.offset = s.offset - s.head + s.got;
    r.buffer = s.buffer + s.got;
    r.length = static_cast<uint32_t>(s.want - s.got);
    if (absl::Status st = backend.Submit({&r, 1}); !st.ok()) {
      if (status.ok()) status = st;
      s.busy = false;
      return;
    }
    ++in_flight;
  };
  // Pieces past the end find it at their own start: the end is the least place one found it.
  uint64_t end_found = UINT64_MAX;
  uint64_t short_piece_end = 0;  // where the piece that found it was to end
  auto ended_early = [&](const Slot& s) {
    const uint64_t end = s.offset - s.head + s.got;
    if (end < end_found) {
      end_found = end;
      short_piece_end = s.offset + s.length;
      // Placeholder: the message is made once every piece in flight has come back.
      return absl::OutOfRangeError("");
    }
    return status;
  };

  for (;;) {
    // Start pieces while slots are free.
    for (uint32_t i = 0; i < depth && status.ok() && !cancel.load(std::memory_order_relaxed); ++i) {
      if (slots[i].busy) continue;
      while (range < ranges.size() && done_in_range == ranges[range].length) {
        ++range;
        done_in_range = 0;
      }
      if (range == ranges.size()) break;
      const ReadRange& r = ranges[range];
      Slot& s = slots[i];
      s.offset = r.offset + done_in_range;
      s.length = std::min(options_.io_size, r.length - done_in_range);
      s.dst = r.dst + done_in_range;
      s.got = 0;
      if (align != 0) {
        s.head = s.offset & (align - 1);
        s.want = (s.head + s.length + align - 1) & ~(align - 1);
      } else {
        s.head = 0;
        s.want = s.length;
        s.buffer = s.dst;
      }
      s.busy = true;
      done_in_range += s.length;
      submit(i);
    }
    if (in_flight == 0) break;
    IoCompletion completions[16];
    const size_t n = backend.Reap(completions, absl::InfiniteDuration());
    for (size_t c = 0; c < n; ++c) {
      --in_flight;
      Slot& s = slots[completions[c].tag];
      const int32_t res = completions[c].result;
      if (res == -EINTR || res == -EAGAIN) {
        if (status.ok()) {
          submit(static_cast<uint32_t>(completions[c].tag));
        } else {
          s.busy = false;
        }
        continue;
      }
      if (res < 0) {
        if (status.ok()) {
          status = absl::ErrnoToStatus(
              -res, absl::StrCat("reading ", file_name, " at byte ", s.offset - s.head + s.got));
        }
        s.busy = false;
        continue;
      }
      const uint64_t got = s.got + static_cast<uint64_t>(res);
      if (got >= s.head + s.length) {
        if (align != 0) std::memcpy(s.dst, s.buffer + s.head, s.length);
        *bytes += s.length;
        s.busy = false;
        continue;
      }
      // Short. A direct read goes on from the last whole block it read (the offset must stay
      // aligned); nothing read, or no whole block more, is the end of the file.
      const uint64_t keep = align != 0 ? got & ~(align - 1) : got;
      if (res == 0 || keep == s.got) {
        s.got = got;
        if (status.ok() || status.code() == absl::StatusCode::kOutOfRange) {
          status = ended_early(s);
        }
        s.busy = false;
        continue;
      }
      s.got = keep;
      // A piece goes on after another found the end of the file: the end may be in this one.
      const bool going = status.ok() || status.code() == absl::StatusCode::kOutOfRange;
      if (going && !cancel.load(std::memory_order_relaxed)) {
        submit(static_cast<uint32_t>(completions[c].tag));
      } else {
        s.busy = false;
      }
    }
  }
  if (status.code() == absl::StatusCode::kOutOfRange && end_found != UINT64_MAX) {
    return absl::OutOfRangeError(absl::StrCat(
        file_name, " ends at byte ", end_found, ", inside a range to read up to byte ",
        short_piece_end, ": it is shorter than it said, or was cut short while it was read"));
  }
  if (status.ok() && cancel.load(std::memory_order_relaxed)) {
    return absl::CancelledError(absl::StrCat("reading ", file_name, ": cancelled"));
  }
  return status;
}

}  // namespace tierd::daemon
