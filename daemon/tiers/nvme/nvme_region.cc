#include "daemon/tiers/nvme/nvme_region.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/sizes.h"

namespace tierd::daemon {

uint64_t SuperblockChecksum(const Superblock& sb) {
  return XXH3_64bits(&sb, offsetof(Superblock, checksum));
}

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment) : size_(size) {
  if (posix_memalign(reinterpret_cast<void**>(&data_), alignment, size) != 0) data_ = nullptr;
  if (data_ != nullptr) std::memset(data_, 0, size);
}
AlignedBuffer::~AlignedBuffer() { free(data_); }

absl::StatusOr<std::unique_ptr<NvmeRegion>> NvmeRegion::Open(const RegionSpec& spec, bool create) {
  auto region = std::unique_ptr<NvmeRegion>(new NvmeRegion());
  region->path_ = spec.path;
  struct stat st {};
  const bool exists = stat(spec.path.c_str(), &st) == 0;
  region->block_device_ = exists && S_ISBLK(st.st_mode);
  if (!exists && !create) {
    return absl::NotFoundError(absl::StrCat("NVMe region '", spec.path, "' does not exist"));
  }
  if (!exists) {
    // Never the directory: a missing one is most often a drive that is not mounted, and creating
    // it would put a region the size of the drive on the file system under the mount point.
    std::filesystem::path dir = std::filesystem::path(spec.path).parent_path();
    if (dir.empty()) dir = ".";
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NVMe region '", spec.path, "': its directory '", dir.string(),
          "' does not exist. Is the drive mounted there? tierd creates region files, never their "
          "directories"));
    }
    if (spec.size == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NVMe region '", spec.path, "' does not exist; give it a size so it can be created"));
    }
  }
  int flags = O_RDWR | O_DIRECT | O_CLOEXEC | (exists ? 0 : O_CREAT);
  if (region->block_device_) flags |= O_EXCL;  // refused while the device is mounted or in use
  region->fd_ = UniqueFd(open(spec.path.c_str(), flags, 0600));
  if (!region->fd_ && errno == EBUSY) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NVMe region '", spec.path,
        "' is a block device in use (mounted, or opened exclusively by another process); "
        "unmount it or name another device"));
  }
  if (!region->fd_) {
    if (errno == EINVAL) {
      return absl::FailedPreconditionError(
          absl::StrCat("NVMe region '", spec.path,
                       "': the file system does not support O_DIRECT (tmpfs?); "
                       "put regions on a file system on the NVMe drive, or use the block device"));
    }
    if (!exists) {  // the directory is there, but this file system takes no new file (/proc)
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create NVMe region '", spec.path, "': ", strerror(errno)));
    }
    return absl::ErrnoToStatus(errno, absl::StrCat("opening NVMe region '", spec.path, "'"));
  }

  if (region->block_device_) {
    int logical = 0;
    uint64_t device_bytes = 0;
    if (ioctl(region->fd(), BLKSSZGET, &logical) != 0 ||
        ioctl(region->fd(), BLKGETSIZE64, &device_bytes) != 0) {
      return absl::ErrnoToStatus(errno, absl::StrCat("block size of '", spec.path, "'"));
    }
    region->block_size_ = static_cast<uint32_t>(logical);
    region->bytes_ = spec.size == 0 ? device_bytes : spec.size;
    if (region->bytes_ > device_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("NVMe region '", spec.path, "' is ",
                                                     FormatSize(device_bytes), ", not ",
                                                     FormatSize(spec.size)));
    }
  } else {
    struct statx sx {};
    uint32_t align = 0;
    if (statx(region->fd(), "", AT_EMPTY_PATH, STATX_DIOALIGN | STATX_SIZE, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align != 0) {
      align = std::max(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
    } else if (fstat(region->fd(), &st) == 0) {
      align = static_cast<uint32_t>(st.st_blksize);  // older kernels: the block size is safe
    }
    region->block_size_ = std::max<uint32_t>(align, 512);
    const uint64_t current = exists ? static_cast<uint64_t>(st.st_size) : 0;
    region->bytes_ = spec.size == 0 ? current : spec.size;
    if (region->bytes_ > current) {
      // Preallocate so that writes never fail for want of space and extents are contiguous.
      if (fallocate(region->fd(), 0, 0, static_cast<off_t>(region->bytes_)) != 0) {
        return absl::ErrnoToStatus(errno, absl::StrCat("fallocate of ", FormatSize(region->bytes_),
                                                       " for NVMe region '", spec.path, "'"));
      }
    }
  }
  struct stat identity {};
  if (fstat(region->fd(), &identity) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("fstat of NVMe region '", spec.path, "'"));
  }
  region->identity_ = region->block_device_
                          ? std::pair<uint64_t, uint64_t>{0, identity.st_rdev}
                          : std::pair<uint64_t, uint64_t>{identity.st_dev, identity.st_ino};
  if (region->bytes_ < 2 * kRegionHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("NVMe region '", spec.path, "' is ",
                                                   FormatSize(region->bytes_),
                                                   "; a region needs at least 2 MiB"));
  }
  return region;
}

NvmeRegion::~NvmeRegion() {
  // Explicitly: an io_uring that registered the file may hold it open a moment longer.
  if (locked_) flock(fd(), LOCK_UN);
}

absl::Status NvmeRegion::Lock() {
  // A daemon that has just died may hold the lock a moment longer: its io_uring, which holds the
  // region open, is torn down after the process is gone.
  for (const absl::Time give_up = absl::Now() + absl::Seconds(3);;) {
    if (flock(fd(), LOCK_EX | LOCK_NB) == 0) {
      locked_ = true;
      return absl::OkStatus();
    }
    if (errno != EWOULDBLOCK) {
      return absl::ErrnoToStatus(errno, absl::StrCat("flock of NVMe region '", path_, "'"));
    }
    if (absl::Now() >= give_up) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "NVMe region '", path_,
      "' is in use by another process (another tierd?); two daemons on one region would destroy "
      "each other's data. Stop it, or give this daemon regions of its own"));
}

// Metadata goes before queued data: a persist waits on its index record.
constexpr IoOrder kMetadataOrder{.deadline = absl::InfinitePast()};

absl::Status NvmeRegion::Run(IoSpan span) const {
  if (engine_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("NVMe region '", path_, "' has no engine"));
  }
  span.file = file_;
  return engine_->RunAndWait({span}, kMetadataOrder);
}

absl::Status NvmeRegion::ReadAt(uint64_t offset, void* buffer, size_t length) const {
  return Run({IoKind::kRead, 0, offset, static_cast<char*>(buffer), length});
}

absl::Status NvmeRegion::WriteAt(uint64_t offset, const void* buffer, size_t length) const {
  // The engine's spans carry one pointer for both directions; a write only reads through it.
  return Run(
      {IoKind::kWrite, 0, offset, const_cast<char*>(static_cast<const char*>(buffer)), length});
}

absl::Status NvmeRegion::Sync() const { return Run({IoKind::kSync}); }

std::unique_ptr<IoEngine> AttachOwnEngine(NvmeRegion& region) {
  const int fd = region.fd();
  auto engine = std::make_unique<IoEngine>(
      MakeThreadPoolBackend(std::span<const int>(&fd, 1), /*queue_depth=*/4, /*threads=*/2),
      IoEngineOptions{.io_size = 1 << 20, .file_names = {region.path()}});
  region.Attach(engine.get(), 0);
  return engine;
}

absl::StatusOr<std::optional<Superblock>> NvmeRegion::ReadSuperblock() const {
  AlignedBuffer block(block_size_, block_size_);
  if (absl::Status s = ReadAt(0, block.data(), block_size_); !s.ok()) return s;
  Superblock sb;
  std::memcpy(&sb, block.data(), sizeof(sb));
  if (std::memcmp(sb.magic, kRegionMagic, sizeof(kRegionMagic)) != 0) return std::nullopt;
  if (sb.checksum != SuperblockChecksum(sb)) {
    return absl::DataLossError(
        absl::StrCat("NVMe region '", path_, "' has a damaged superblock (checksum mismatch)"));
  }
  return sb;
}

absl::Status NvmeRegion::WriteSuperblock(Superblock sb) const {
  std::memcpy(sb.magic, kRegionMagic, sizeof(kRegionMagic));
  sb.checksum = SuperblockChecksum(sb);
  AlignedBuffer block(block_size_, block_size_);
  std::memcpy(block.data(), &sb, sizeof(sb));
  if (absl::Status s = WriteAt(0, block.data(), block_size_); !s.ok()) return s;
  return Sync();
}

}  // namespace tierd::daemon
