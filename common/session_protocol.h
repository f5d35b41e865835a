// Messages on the session socket (SOCK_SEQPACKET, one message per packet, host byte order: both
// ends are on the same node). The socket is open for the whole session; closing it ends the
// session. Protocol: docs/sessions.md.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace tierd {

inline constexpr uint32_t kSessionMagic = 0x54495244;  // "TIRD"
inline constexpr uint16_t kSessionProtocolVersion = 1;
inline constexpr int kSessionTokenBytes = 32;
inline constexpr int kMaxSegmentsPerHello = 64;
// A job label: 1 to 63 of [A-Za-z0-9._:/-]; at most this many distinct jobs have sessions at once.
inline constexpr int kMaxJobBytes = 63;
inline constexpr int kMaxLiveJobs = 64;

enum class SessionMessageType : uint16_t {
  kHello = 1,       // client → daemon: open a session
  kHelloReply = 2,  // daemon → client: credential, page fd, segment fds
  kMapSegment = 3,  // client → daemon: send me this segment's fd
  kMapSegmentReply = 4,
  kImport = 5,  // client → daemon: read these byte ranges of a file into a chunk I hold
  kImportReply = 6,
};

struct SessionMessageHeader {
  uint32_t magic;
  uint16_t version;
  SessionMessageType type;
};

struct HelloRequest {
  SessionMessageHeader header;
  char client_name[64];  // for logs; NUL-terminated
  // The job the session belongs to (metrics and tierctl attribute its chunks and traffic to it);
  // NUL-terminated, empty for none. A client older than the field sends the message without it.
  char job[kMaxJobBytes + 1];
};
inline constexpr size_t kHelloRequestWithoutJob = offsetof(HelloRequest, job);

struct SegmentDescriptor {
  uint32_t segment;
  uint32_t reserved;
  uint64_t generation;
  uint64_t size_bytes;
};

// On success carries fds in SCM_RIGHTS: the completion page first, then one per segment listed.
struct HelloReply {
  SessionMessageHeader header;
  int32_t status_code;  // absl::StatusCode; 0 is OK
  uint32_t uid;
  uint64_t session_id;
  char token_hex[2 * kSessionTokenBytes + 1];
  char message[255];
  uint32_t segment_count;
  uint32_t reserved;
  SegmentDescriptor segments[kMaxSegmentsPerHello];
};

struct MapSegmentRequest {
  SessionMessageHeader header;
  uint32_t segment;
  uint32_t tier;  // 1 host, 3 device (values of tierd.v1.Tier)
};

// On success carries the segment's fd in SCM_RIGHTS: a memfd (host tier, emulated device) or a
// CUDA VMM allocation's POSIX fd (device tier), which the client imports on the GPU with this UUID.
struct MapSegmentReply {
  SessionMessageHeader header;
  int32_t status_code;
  uint32_t tier;
  SegmentDescriptor segment;
  uint32_t emulated;  // device tier: the memory is host memory standing in for a GPU's
  char device_uuid[48];
  char message[256];
};

// An import: the daemon reads byte ranges of the file whose fd the message carries (SCM_RIGHTS,
// exactly one: a regular file open for reading) into a chunk that the session holds acquired for
// writing in the host tier. `file_size` and `file_mtime_ns` are what the client saw when it read
// the file's layout (fstat); a file that differs, or changes while it is read, is refused. The
// message is the fields up to `ranges` and then `count` ranges (1 .. kMaxImportRanges), which lie
// in the file and the chunk and do not overlap in the chunk. One import per session at a time.
inline constexpr int kMaxImportRanges = 256;

struct ImportRange {
  uint64_t file_offset;
  uint64_t chunk_offset;
  uint64_t length;
};

struct ImportRequest {
  SessionMessageHeader header;
  uint32_t count;
  uint32_t reserved;
  uint64_t chunk;
  uint64_t file_size;
  int64_t file_mtime_ns;
  ImportRange ranges[kMaxImportRanges];
};
inline constexpr size_t kImportRequestHead = offsetof(ImportRequest, ranges);

// Sent once the ranges are read (or the import failed); the chunk's contents are the file's only
// when status_code is 0.
struct ImportReply {
  SessionMessageHeader header;
  int32_t status_code;
  uint32_t direct;  // the daemon read with O_DIRECT (the page cache was not filled)
  uint64_t bytes;   // bytes read from the file
  char message[256];
};

// Copies `src` into a message's text field, cut to fit and NUL-terminated.
template <size_t N>
void CopyText(char (&dst)[N], absl::string_view src) {
  const size_t n = std::min(src.size(), N - 1);
  if (n > 0) std::memcpy(dst, src.data(), n);  // an empty view's data() may be null
  dst[n] = '\0';
}

inline SessionMessageHeader MakeHeader(SessionMessageType type) {
  return SessionMessageHeader{kSessionMagic, kSessionProtocolVersion, type};
}

}  // namespace tierd
