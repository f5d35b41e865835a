#include "daemon/tiers/nvme/nvme_tier.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/fmt_absl.h"
#include "common/sizes.h"
#include "daemon/util/daemon_files.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
std::string InstanceIdHex(const InstanceId& id) {
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(id.data()), id.size()));
}

absl::StatusOr<InstanceId> LoadOrCreateInstanceId(const std::string& state_dir) {
  const std::string path = state_dir + "/instance_id";
  InstanceId id{};
  std::ifstream in(path);
  if (in) {
    std::string hex;
    in >> hex;
    if (hex.size() != 32 ||
        !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
      return absl::DataLossError(absl::StrCat(
          "'", path,
          "' does not hold a tierd instance id (it is damaged). The NVMe regions name "
          "the instance that formatted them: restore the file from their superblocks' owner, or "
          "remove it and start over with --nvme_reformat (this discards the persistent chunks)"));
    }
    std::string bytes = absl::HexStringToBytes(hex);
    std::copy(bytes.begin(), bytes.end(), id.begin());
    return id;
  }
  if (getrandom(id.data(), id.size(), 0) != static_cast<ssize_t>(id.size())) {
    return absl::ErrnoToStatus(errno, "getrandom for the instance id");
  }
  // Written whole or not at all: a full file system fails this start, never the next one.
  if (absl::Status s = WriteFileAtomically(path, InstanceIdHex(id) + "\n", 0644); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("recording the instance id: ", s.message()));
  }
  spdlog::info("new tierd instance {} (recorded in {})", InstanceIdHex(id), path);
  return id;
}

namespace {

// Index records kept free beyond the live ones' share, for the log between compactions.
constexpr uint64_t kIndexSpare = 64;
// Threads of the pread/pwrite backend: as many as I/Os in flight, up to this.
constexpr uint32_t kMaxIoThreads = 64;

// The record, in the state directory, of the region set this instance formatted: when and which
// regions. Its presence says the regions hold data; they are never formatted anew without
// --nvme_reformat.
struct RegionSetRecord {
  int64_t formatted_unix_seconds = 0;
  std::vector<std::string> paths;
};

std::string RecordPath(const std::string& state_dir) { return state_dir + "/nvme_regions"; }

std::optional<RegionSetRecord> ReadRegionSetRecord(const std::string& state_dir) {
  if (state_dir.empty()) return std::nullopt;
  std::ifstream in(RecordPath(state_dir));
  if (!in) return std::nullopt;
  RegionSetRecord record;
  std::string word;
  while (in >> word) {
    if (word == "formatted") {
      in >> record.formatted_unix_seconds;
    } else if (word == "region") {
      std::string path;
      std::getline(in >> std::ws, path);
      record.paths.push_back(path);
    }
  }
  return record;
}

absl::Status WriteRegionSetRecord(const std::string& state_dir, int64_t formatted,
                                  const std::vector<std::unique_ptr<NvmeRegion>>& regions) {
  if (state_dir.empty()) return absl::OkStatus();
  std::string text = absl::StrCat("formatted ", formatted, "\n");
  for (const auto& r : regions) absl::StrAppend(&text, "region ", r->path(), "\n");
  return WriteFileAtomically(RecordPath(state_dir), text, 0644);
}

std::string LostRegionsFix(const std::string& state_dir, const RegionSetRecord& record) {
  return absl::StrCat(
      "this instance formatted its region set (", absl::StrJoin(record.paths, ", "), ") at ",
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC",
                       absl::FromUnixSeconds(record.formatted_unix_seconds), absl::UTCTimeZone()),
      " (", RecordPath(state_dir),
      ") and its persistent chunks are there. Restore the region (mount its file system, "
      "reattach the drive), or start an empty set with --nvme_reformat, which discards them");
}

}  // namespace

absl::StatusOr<std::unique_ptr<NvmeTier>> NvmeTier::Open(const NvmeOptions& options,
                                                         const InstanceId& instance,
                                                         SegmentPool* host,
                                                         const std::string& state_dir) {
  if (options.regions.empty()) return absl::InvalidArgumentError("no NVMe regions configured");
  const uint64_t unit = options.stripe_unit;
  if (unit < 4096 || (unit & (unit - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme.stripe_unit (", unit, " bytes) must be a power of two of at least 4 KiB"));
  }
  if (options.io_size < 4096 || options.io_size > unit || options.io_size % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme.io_size (", FormatSize(options.io_size),
        ") must be a multiple of 4 KiB and at most nvme.stripe_unit (", FormatSize(unit), ")"));
  }
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError("nvme.queue_depth must be 1 to 4096");
  }
  auto tier = std::unique_ptr<NvmeTier>(new NvmeTier());
  tier->host_ = host;
  tier->stripe_unit_ = unit;
  const std::optional<RegionSetRecord> record = ReadRegionSetRecord(state_dir);
  for (const RegionSpec& spec : options.regions) {
    absl::StatusOr<std::unique_ptr<NvmeRegion>> region =
        NvmeRegion::Open(spec, /*create=*/!record.has_value() || options.reformat);
    // NotFound only when the region must exist: a record says the set was formatted.
    if (absl::IsNotFound(region.status()) && record.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NVMe region '", spec.path, "' is missing, but ", LostRegionsFix(state_dir, *record)));
    }
    if (!region.ok()) return region.status();
    for (const auto& other : tier->regions_) {
      if (other->identity() == (*region)->identity()) {
        return absl::InvalidArgumentError(
            absl::StrCat("NVMe regions '", other->path(), "' and '", spec.path,
                         "' are the same file or device; each region must be one of its own"));
      }
    }
    if (absl::Status s = (*region)->Lock(); !s.ok()) return s;
    tier->block_ = std::max(tier->block_, (*region)->block_size());
    tier->regions_.push_back(std::move(*region));
  }
  if (tier->block_ > 4096) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NVMe regions need ", tier->block_,
        "-byte direct I/O; the host tier allocates in 4 KiB units, so at most 4096 is supported"));
  }
  tier->block_ = std::max<uint32_t>(tier->block_, 512);
  // The engine first: the superblocks and the index are read and written through it, as the
  // data is, so that a fault injected into the backend reaches them too.
  std::vector<int> fds;
  std::vector<std::string> names;
  for (const auto& region : tier->regions_) {
    fds.push_back(region->fd());
    names.push_back(region->path());
  }
  const uint32_t segments = host->segment_count();
  std::unique_ptr<IoBackend> b;
  if (options.io_backend != IoBackendKind::kThreads) {
    absl::StatusOr<std::unique_ptr<IoBackend>> uring = MakeUringBackend(
        fds, UringOptions{options.queue_depth, std::max<uint32_t>(segments, 1), options.sqpoll});
    if (uring.ok()) {
      b = std::move(*uring);
      tier->io_backend_ = IoBackendKind::kUring;
    } else if (options.io_backend == IoBackendKind::kUring) {
      return absl::Status(uring.status().code(),
                          absl::StrCat("nvme.io_backend is io_uring, but ",
                                       uring.status().message(), "; set it to auto or threads"));
    } else {
      spdlog::warn(
          "NVMe: io_uring is unavailable ({}): a container's seccomp profile (Docker's default), "
          "gVisor or an old kernel refuses it. Using {} threads of pread/pwrite instead, which "
          "costs CPU per I/O; allow io_uring_setup/io_uring_enter/io_uring_register for the "
          "daemon, or set nvme.io_backend = \"threads\" to say this is intended",
          uring.status().message(), std::min<uint32_t>(options.queue_depth, kMaxIoThreads));
    }
  }
  if (b == nullptr) {
    b = MakeThreadPoolBackend(fds, options.queue_depth,
                              std::min<uint32_t>(options.queue_depth, kMaxIoThreads));
    tier->io_backend_ = IoBackendKind::kThreads;
  }
  if (options.wrap_backend) b = options.wrap_backend(std::move(b));
  tier->engine_ = std::make_unique<IoEngine>(std::move(b), IoEngineOptions{options.io_size, names});
  tier->worker_ = std::make_unique<WorkQueue>();
  for (uint32_t i = 0; i < tier->regions_.size(); ++i) {
    tier->regions_[i]->Attach(tier->engine_.get(), i);
  }
  const uint32_t n = static_cast<uint32_t>(tier->regions_.size());
  uint64_t index_bytes = 0;
  if (options.index_size != 0) {
    index_bytes = AlignUp(std::max<uint64_t>(options.index_size, 64 << 10), 1 << 20);
  } else {
    // Enough records that every persistent chunk may be as small as 4 MiB: the live records fill
    // at most 4/5 of a half (the rest is the log's room between compactions).
    uint64_t volume = 0;
    for (const auto& region : tier->regions_) volume += region->bytes();
    const uint64_t records = std::max<uint64_t>(1024, volume / (4 << 20) * 5 / 4 + kIndexSpare);
    index_bytes = AlignUp(2 * records * tier->block_, 1 << 20);
  }

  std::vector<std::optional<Superblock>> sbs;
  size_t formatted = 0;
  for (const auto& region : tier->regions_) {
    absl::StatusOr<std::optional<Superblock>> sb = region->ReadSuperblock();
    if (!sb.ok() && !options.reformat) return sb.status();
    sbs.push_back(sb.ok() ? *sb : std::nullopt);
    formatted += sbs.back().has_value();
  }

  if (formatted == 0 && record.has_value() && !options.reformat) {
    return absl::FailedPreconditionError(
        absl::StrCat("the NVMe regions are blank (never formatted, or emptied), but ",
                     LostRegionsFix(state_dir, *record)));
  }
  bool fresh = false;
  if (formatted == 0 || options.reformat) {
    const uint64_t data_offset = kRegionHeaderBytes + index_bytes;
    uint64_t per_region = UINT64_MAX;
    for (const auto& region : tier->regions_) {
      if (region->bytes() <= data_offset + unit) {
        return absl::InvalidArgumentError(
            absl::StrCat("NVMe region '", region->path(), "' (", FormatSize(region->bytes()),
                         ") is too small for its header, index and one stripe unit"));
      }
      per_region = std::min(per_region, (region->bytes() - data_offset) / unit * unit);
    }
    for (uint32_t i = 0; i < n; ++i) {
      Superblock sb{};
      sb.version = kRegionFormatVersion;
      sb.block_size = tier->block_;
      std::copy(instance.begin(), instance.end(), sb.instance_id);
      sb.region_index = i;
      sb.region_count = n;
      sb.region_bytes = tier->regions_[i]->bytes();
      sb.stripe_unit = unit;
      sb.index_offset = kRegionHeaderBytes;
      sb.index_bytes = index_bytes;
      sb.data_offset = data_offset;
      sb.data_bytes = per_region;
      sb.formatted_unix_seconds = static_cast<uint64_t>(time(nullptr));
      if (absl::Status s = tier->regions_[i]->WriteSuperblock(sb); !s.ok()) return s;
      sbs[i] = sb;
    }
    fresh = true;
    if (absl::Status s = WriteRegionSetRecord(
            state_dir, static_cast<int64_t>(sbs[0]->formatted_unix_seconds), tier->regions_);
        !s.ok()) {
      return s;
    }
    spdlog::info("NVMe: formatted {} region(s) for instance {}", n, InstanceIdHex(instance));
  } else if (formatted < n) {
    std::vector<std::string> blank;
    for (uint32_t i = 0; i < n; ++i) {
      if (!sbs[i]) blank.push_back(tier->regions_[i]->path());
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "NVMe regions ", absl::StrJoin(blank, ", "),
        " are blank but the others belong to a formatted region set; a set cannot gain regions. "
        "Restore the original regions, or start over with --nvme_reformat (this discards the "
        "persistent chunks stored there)"));
  }
  for (uint32_t i = 0; i < n; ++i) {
    const Superblock& sb = *sbs[i];
    const std::string& path = tier->regions_[i]->path();
    if (sb.version != kRegionFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NVMe region '", path, "' has on-disk format version ", sb.version, "; this tierd reads ",
          kRegionFormatVersion, ". Use a matching tierd, or --nvme_reformat to start over"));
    }
    if (!std::equal(instance.begin(), instance.end(), sb.instance_id)) {
      InstanceId other;
      std::copy(sb.instance_id, sb.instance_id + 16, other.begin());
      return absl::FailedPreconditionError(absl::StrCat(
          "NVMe region '", path, "' belongs to another tierd instance (", InstanceIdHex(other),
          "); this daemon is instance ", InstanceIdHex(instance),
          ". Point nvme.regions at this daemon's regions, or pass --nvme_reformat to take the "
          "region over (this discards its data)"));
    }
    if (sb.region_count != n || sb.region_index != i) {
      return absl::FailedPreconditionError(
          absl::StrCat("NVMe region '", path, "' is region ", sb.region_index, " of a set of ",
                       sb.region_count, " but is configured as region ", i, " of ", n,
                       "; list the regions in their original order"));
    }
    if (sb.stripe_unit != unit) {
      return absl::FailedPreconditionError(
          absl::StrCat("NVMe region '", path, "' was formatted with a stripe unit of ",
                       FormatSize(sb.stripe_unit), ", not ", FormatSize(unit),
                       "; set nvme.stripe_unit back, or --nvme_reformat"));
    }
  }
  if (!fresh && !record.has_value()) {
    // A set formatted before this record existed: record it now.
    if (absl::Status s = WriteRegionSetRecord(
            state_dir, static_cast<int64_t>(sbs[0]->formatted_unix_seconds), tier->regions_);
        !s.ok()) {
      return s;
    }
  }
  tier->data_offset_ = sbs[0]->data_offset;
  tier->region_data_bytes_ = sbs[0]->data_bytes;
  tier->capacity_ = tier->region_data_bytes_ * n;
  tier->alignment_ = 4096;
  {
    absl::MutexLock lock(&tier->mu_);
    tier->space_ = std::make_unique<ExtentAllocator>(tier->capacity_, tier->alignment_);
    tier->region_used_.assign(n, 0);
  }

  absl::StatusOr<std::unique_ptr<NvmeIndex>> index =
      NvmeIndex::Open(tier->regions_[0].get(), sbs[0]->index_offset, sbs[0]->index_bytes, fresh);
  if (!index.ok()) return index.status();
  tier->index_ = std::move(*index);
  tier->index_records_ = tier->index_->capacity_records();
  const uint64_t live = std::max<uint64_t>(
      1,
      (tier->index_records_ - std::min<uint64_t>(tier->index_records_ - 1, kIndexSpare)) * 4 / 5);
  tier->persistent_granule_ = AlignUp((tier->capacity_ + live - 1) / live, 4096);
  for (const auto& [key, entry] : tier->index_->entries()) tier->recovered_.push_back(entry);

  {
    absl::MutexLock lock(&tier->mu_);
    tier->registered_.assign(segments, false);
  }
  NvmeTier* raw = tier.get();
  tier->observer_ = host->AddRemapObserver([raw](uint32_t segment, void*, void* base, size_t size) {
    // A removed observer keeps its slots: the engine and its registrations go together.
    if (base == nullptr) return;
    absl::Status s = raw->engine_->backend()->RegisterBuffer(static_cast<int>(segment), base, size);
    if (!s.ok()) {
      spdlog::warn(
          "NVMe: host segment {} not registered with io_uring ({}); its I/O pins pages "
          "per request",
          segment, s.message());
    }
    absl::MutexLock lock(&raw->mu_);
    if (segment < raw->registered_.size()) raw->registered_[segment] = s.ok();
  });
  spdlog::info("NVMe tier: {}", tier->Describe());
  return tier;
}

NvmeTier::~NvmeTier() {
  if (host_ != nullptr && observer_ != 0) host_->RemoveRemapObserver(observer_);
  if (engine_ != nullptr) Drain();
}

int32_t NvmeTier::BufferIndex(uint32_t segment) const {
  absl::MutexLock lock(&mu_);
  return segment < registered_.size() && registered_[segment] ? static_cast<int32_t>(segment) : -1;
}

std::vector<IoSpan> NvmeTier::Spans(IoKind kind, uint64_t offset, uint64_t length, char* buffer,
                                    int32_t buffer_index) const {
  const uint64_t n = regions_.size();
  std::vector<IoSpan> spans;
  uint64_t done = 0;
  while (done < length) {
    const uint64_t logical = offset + done;
    const uint64_t unit = logical / stripe_unit_;
    const uint64_t within = logical % stripe_unit_;
    const uint64_t piece = std::min(stripe_unit_ - within, length - done);
    spans.push_back(IoSpan{kind, static_cast<uint32_t>(unit % n),
                           data_offset_ + (unit / n) * stripe_unit_ + within,
                           buffer == nullptr ? nullptr : buffer + done, piece, buffer_index});
    done += piece;
  }
  return spans;
}

void NvmeTier::AddRegionUse(uint64_t offset, uint64_t length, int64_t sign) {
  for (const IoSpan& s : Spans(IoKind::kRead, offset, length, nullptr, -1)) {
    region_used_[s.file] += sign * static_cast<int64_t>(s.length);
  }
}

absl::StatusOr<Placement> NvmeTier::Reserve(uint32_t /*tenant*/, uint64_t size) {
  if (size == 0 || size > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat("the NVMe tier cannot hold a chunk of ", size,
                                                   " bytes (capacity ", FormatSize(capacity_),
                                                   ")"));
  }
  absl::MutexLock lock(&mu_);
  // Chunks of a stripe unit or more start on a unit boundary: each sub-I/O then covers a whole
  // unit and the chunk spreads evenly over the regions.
  const uint64_t align = size >= stripe_unit_ ? stripe_unit_ : alignment_;
  std::optional<uint64_t> offset = space_->AllocateAligned(size, align);
  if (!offset) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "NVMe tier full: no room for ", FormatSize(size), ": ", FormatSize(space_->used_bytes()),
        " of ", FormatSize(capacity_), " in use, largest free extent ",
        FormatSize(space_->largest_free()), "; free chunks or add regions (nvme.regions)"));
  }
  const uint64_t reserved = space_->RoundUp(size);
  AddRegionUse(*offset, reserved, +1);
  return Placement{TierKind::kNvme, 0, 0, *offset, reserved};
}

void NvmeTier::Unreserve(const Placement& placement) {
  absl::MutexLock lock(&mu_);
  space_->Free(placement.offset, placement.size);
  AddRegionUse(placement.offset, placement.size, -1);
}

bool NvmeTier::Claim(const Placement& placement) {
  absl::MutexLock lock(&mu_);
  if (!space_->AllocateAt(placement.offset, placement.size)) return false;
  AddRegionUse(placement.offset, placement.size, +1);
  return true;
}

std::vector<IndexEntry> NvmeTier::RecoveredEntries() const { return recovered_; }

TierUsage NvmeTier::Usage() const {
  absl::MutexLock lock(&mu_);
  return TierUsage{capacity_, space_->used_bytes(), space_->largest_free()};
}

std::string NvmeTier::Describe() const {
  std::vector<std::string> paths;
  for (const auto& r : regions_) paths.push_back(r->path());
  return absl::StrCat(regions_.size(), " region(s) striped by ", FormatSize(stripe_unit_), " (",
                      FormatSize(capacity_), "): ", absl::StrJoin(paths, ", "), "; ", block_,
                      "-byte blocks, io_size ", FormatSize(engine_ ? io_size() : 0),
                      ", queue depth ", engine_ ? queue_depth() : 0, ", ",
                      io_backend_ == IoBackendKind::kUring ? "io_uring" : "pread/pwrite threads");
}

std::vector<RegionStatus> NvmeTier::Regions() const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionStatus> out;
  for (size_t i = 0; i < regions_.size(); ++i) {
    out.push_back(
        {regions_[i]->path(), region_data_bytes_, region_used_[i], regions_[i]->block_size()});
  }
  return out;
}

}  // namespace tierd::daemon
