// NVMe regions: files (preallocated with fallocate) or raw block devices, opened with O_DIRECT,
// each starting with a checksummed superblock that ties it to one tierd instance and one region
// set. On-disk format: docs/architecture.md, "The NVMe tier on disk".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/io/io_engine.h"

namespace tierd::daemon {

inline constexpr char kRegionMagic[8] = {'T', 'I', 'E', 'R', 'D', 'R', 'G', 'N'};
inline constexpr uint32_t kRegionFormatVersion = 1;
inline constexpr uint64_t kRegionHeaderBytes = 1 << 20;  // superblock area at the start

struct RegionSpec {
  std::string path;
  uint64_t size = 0;  // bytes; 0: the whole block device, or an existing file's size
};

// The superblock, stored in the first block of every region.
struct Superblock {
  char magic[8];
  uint32_t version;
  uint32_t block_size;
  uint8_t instance_id[16];  // the tierd instance that owns the region set
  uint32_t region_index;
  uint32_t region_count;
  uint64_t region_bytes;
  uint64_t stripe_unit;
  uint64_t index_offset;  // region 0 only; the same numbers are stored in every region
  uint64_t index_bytes;
  uint64_t data_offset;
  uint64_t data_bytes;  // per region, a multiple of stripe_unit
  uint64_t formatted_unix_seconds;
  uint64_t checksum;  // XXH3-64 of every byte before it
};
static_assert(sizeof(Superblock) == 104);

uint64_t SuperblockChecksum(const Superblock& sb);

class NvmeRegion {
 public:
  // Opens with O_DIRECT (a block device also with O_EXCL: not one that is mounted), creating and
  // preallocating a file when it does not exist and `create` allows it. The block size is the
  // device's logical block size (BLKSSZGET) or the file system's direct-I/O alignment (statx),
  // never assumed.
  static absl::StatusOr<std::unique_ptr<NvmeRegion>> Open(const RegionSpec& spec,
                                                          bool create = true);
  ~NvmeRegion();
  // Takes an exclusive lock on the region for this object's life: FAILED_PRECONDITION when
  // another process (another tierd) holds it.
  absl::Status Lock();
  // What the region is on the node: the same for two paths to one file or device.
  std::pair<uint64_t, uint64_t> identity() const { return identity_; }

  int fd() const { return fd_.get(); }
  const std::string& path() const { return path_; }
  uint32_t block_size() const { return block_size_; }
  uint64_t bytes() const { return bytes_; }
  bool block_device() const { return block_device_; }

  // nullopt when the region has never been formatted (its first block is not a superblock).
  // DATA_LOSS when it looks like a superblock but its checksum does not match.
  absl::StatusOr<std::optional<Superblock>> ReadSuperblock() const;
  // Writes the superblock and makes it durable (start-up only: synchronous).
  absl::Status WriteSuperblock(Superblock sb) const;

  // The engine that does this region's I/O, and the region's file index in it. REQUIRES: before
  // any of the I/O below, and the engine outlives the region's use.
  void Attach(IoEngine* engine, uint32_t file) {
    engine_ = engine;
    file_ = file;
  }
  // Synchronous, block-aligned I/O for start-up and the index, through the attached engine, so
  // that its backend's fault injection reaches it too. REQUIRES: not on the engine's thread;
  // aligned buffer, offset and length.
  absl::Status ReadAt(uint64_t offset, void* buffer, size_t length) const;
  absl::Status WriteAt(uint64_t offset, const void* buffer, size_t length) const;
  absl::Status Sync() const;

 private:
  // Runs `span` on this region's file through the engine and waits for it.
  absl::Status Run(IoSpan span) const;

  UniqueFd fd_;
  std::string path_;
  uint32_t block_size_ = 4096;
  uint64_t bytes_ = 0;
  bool block_device_ = false;
  bool locked_ = false;
  IoEngine* engine_ = nullptr;
  uint32_t file_ = 0;
  std::pair<uint64_t, uint64_t>
      identity_{};  // (st_dev, st_ino) of a file; (0, st_rdev) of a device
};

// Attaches to `region` an engine of its own (a small pool of pread/pwrite threads) and returns it:
// for tools and tests that read or write one region's metadata outside a tier. The engine must
// outlive the region's I/O.
std::unique_ptr<IoEngine> AttachOwnEngine(NvmeRegion& region);

// An aligned heap buffer for O_DIRECT.
class AlignedBuffer {
 public:
  AlignedBuffer(size_t size, size_t alignment);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tierd::daemon
