#include "daemon/tiers/nvme/nvme_index.h"

#include <sys/random.h>
#include <xxhash.h>

#include <cerrno>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

constexpr uint32_t kRecordMagic = 0x58444954;  // "TIDX"
enum RecordType : uint16_t { kHeader = 1, kPut = 2, kRemove = 3 };

struct RecordHeader {
  uint32_t magic;
  uint16_t type;
  uint16_t name_length;
  uint64_t generation;
  uint64_t sequence;
  uint32_t tenant;
  uint32_t flags;  // kMemoryHome | kInMemory (0 in records written before they existed)
  uint64_t chunk_size;
  uint64_t offset;
  uint64_t reserved;
  uint64_t checksum;
};
static_assert(sizeof(RecordHeader) == 64);
constexpr uint32_t kMemoryHome = 1;
constexpr uint32_t kInMemory = 2;
constexpr size_t kMaxName = 255;

uint64_t BlockChecksum(const char* block, uint32_t size) { return XXH3_64bits(block, size - 8); }

}  // namespace

std::string NvmeIndex::Key(uint32_t tenant, const std::string& name) {
  return absl::StrCat(tenant, "/", name);
}

NvmeIndex::NvmeIndex(const NvmeRegion* region, uint64_t offset, uint64_t bytes)
    : region_(region),
      offset_(offset),
      block_(region->block_size()),
      half_blocks_(bytes / 2 / region->block_size()) {}

absl::StatusOr<std::unique_ptr<NvmeIndex>> NvmeIndex::Open(const NvmeRegion* region,
                                                           uint64_t offset, uint64_t bytes,
                                                           bool fresh) {
  auto index = std::unique_ptr<NvmeIndex>(new NvmeIndex(region, offset, bytes));
  if (index->half_blocks_ < 2 || sizeof(RecordHeader) + kMaxName + 8 > index->block_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NVMe index area of ", bytes, " bytes is too small for block size ", index->block_));
  }
  if (fresh) {
    // The area may hold an earlier index (a region set formatted again): its records must never
    // count. A generation no earlier index can have used (random, far from wrapping), a header
    // for it in half 0, and half 1's header made invalid.
    uint64_t generation = 0;
    if (getrandom(&generation, sizeof(generation), 0) != sizeof(generation)) {
      return absl::ErrnoToStatus(errno, "getrandom for the NVMe index's generation");
    }
    index->generation_ = (generation & ((uint64_t{1} << 62) - 1)) | 1;
    index->active_ = 0;
    AlignedBuffer blank(index->block_, index->block_);
    if (absl::Status s = region->WriteAt(index->HalfOffset(1), blank.data(), index->block_);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = index->WriteHeader(0, index->generation_); !s.ok()) return s;
    return index;
  }
  if (absl::Status s = index->Replay(); !s.ok()) return s;
  return index;
}

void NvmeIndex::Encode(int type, const IndexEntry& e, uint64_t generation, char* block) {
  std::memset(block, 0, block_);
  RecordHeader h{kRecordMagic,
                 static_cast<uint16_t>(type),
                 static_cast<uint16_t>(e.name.size()),
                 generation,
                 ++sequence_,
                 e.tenant,
                 (e.memory_home ? kMemoryHome : 0u) | (e.in_memory ? kInMemory : 0u),
                 e.chunk_size,
                 e.offset,
                 e.reserved,
                 e.checksum};
  std::memcpy(block, &h, sizeof(h));
  std::memcpy(block + sizeof(h), e.name.data(), e.name.size());
  const uint64_t sum = BlockChecksum(block, block_);
  std::memcpy(block + block_ - 8, &sum, 8);
}

absl::Status NvmeIndex::WriteHeader(int half, uint64_t generation) {
  AlignedBuffer block(block_, block_);
  Encode(kHeader, IndexEntry{}, generation, block.data());
  if (absl::Status s = region_->WriteAt(HalfOffset(half), block.data(), block_); !s.ok()) return s;
  return region_->Sync();
}

absl::Status NvmeIndex::Replay() {
  // The valid header with the higher generation names the active half.
  AlignedBuffer header(block_, block_);
  uint64_t generation[2] = {0, 0};
  for (int half = 0; half < 2; ++half) {
    if (absl::Status s = region_->ReadAt(HalfOffset(half), header.data(), block_); !s.ok()) {
      return s;
    }
    RecordHeader h;
    const char* b = header.data();
    std::memcpy(&h, b, sizeof(h));
    uint64_t sum;
    std::memcpy(&sum, b + block_ - 8, 8);
    if (h.magic == kRecordMagic && h.type == kHeader && sum == BlockChecksum(b, block_)) {
      generation[half] = h.generation;
    }
  }
  if (generation[0] == 0 && generation[1] == 0) {
    return absl::DataLossError(
        absl::StrCat("the NVMe index in '", region_->path(),
                     "' has no valid header: the persistent chunks it held cannot be found"));
  }
  active_ = generation[1] > generation[0] ? 1 : 0;
  generation_ = generation[active_];
  // The log is read in pieces, up to its end: records are appended one at a time from block 1,
  // so the current generation's records are contiguous but for a torn last append, and a run of
  // blocks that are not its own means the log ended before them.
  constexpr uint64_t kEndRun = 64;
  const uint64_t piece_blocks = std::max<uint64_t>(1, (1 << 20) / block_);
  AlignedBuffer piece(piece_blocks * block_, block_);
  tail_ = 1;
  uint64_t foreign_run = 0;
  for (uint64_t first = 1; first < half_blocks_ && foreign_run < kEndRun; first += piece_blocks) {
    const uint64_t n = std::min(piece_blocks, half_blocks_ - first);
    if (absl::Status s =
            region_->ReadAt(HalfOffset(active_) + first * block_, piece.data(), n * block_);
        !s.ok()) {
      return s;
    }
    for (uint64_t k = 0; k < n && foreign_run < kEndRun; ++k) {
      const uint64_t i = first + k;
      const char* b = piece.data() + k * block_;
      RecordHeader h;
      std::memcpy(&h, b, sizeof(h));
      uint64_t sum;
      std::memcpy(&sum, b + block_ - 8, 8);
      const bool valid =
          h.magic == kRecordMagic && sum == BlockChecksum(b, block_) && h.name_length <= kMaxName;
      if (!valid) {
        if (h.magic == kRecordMagic && h.generation == generation_) {
          spdlog::warn("NVMe index: record {} of generation {} in '{}' is torn or corrupt; skipped",
                       i, generation_, region_->path());
          ++skipped_;
          tail_ = i + 1;
          foreign_run = 0;
        } else {
          ++foreign_run;
        }
        continue;
      }
      if (h.generation != generation_) {  // left over from an earlier use of this half
        ++foreign_run;
        continue;
      }
      foreign_run = 0;
      tail_ = i + 1;
      sequence_ = std::max(sequence_, h.sequence);
      IndexEntry e{h.tenant,
                   std::string(b + sizeof(h), h.name_length),
                   h.chunk_size,
                   h.offset,
                   h.reserved,
                   h.checksum,
                   (h.flags & kMemoryHome) != 0,
                   (h.flags & kInMemory) != 0};
      if (h.type == kPut || h.type == kRemove) Apply(h.type, std::move(e));
    }
  }
  spdlog::info("NVMe index: generation {}, {} persistent chunks, {} records skipped", generation_,
               entries_.size(), skipped_);
  return absl::OkStatus();
}

void NvmeIndex::Apply(int type, IndexEntry e) {
  const std::string key = Key(e.tenant, e.name);
  if (auto it = entries_.find(key); it != entries_.end()) {
    if (it->second.reserved != 0) by_offset_.erase(it->second.offset);
    entries_.erase(it);
  }
  if (type != kPut) return;
  if (e.reserved == 0) {  // no space on NVMe: nothing to overlap
    entries_[key] = std::move(e);
    return;
  }
  // A later record whose space overlaps an earlier entry means that space was freed and reused:
  // the earlier entry is stale.
  const uint64_t begin = e.offset, end = e.offset + e.reserved;
  auto it = by_offset_.lower_bound(begin);
  if (it != by_offset_.begin()) --it;
  while (it != by_offset_.end() && it->first < end) {
    const IndexEntry& other = entries_.at(it->second);
    if (other.offset + other.reserved > begin) {
      spdlog::info("NVMe index: '{}' lost its space to '{}'; dropped", it->second, key);
      entries_.erase(it->second);
      it = by_offset_.erase(it);
    } else {
      ++it;
    }
  }
  by_offset_[e.offset] = key;
  entries_[key] = std::move(e);
}

absl::Status NvmeIndex::Append(int type, const IndexEntry& entry) {
  if (tail_ >= half_blocks_) {
    if (absl::Status s = Compact(); !s.ok()) return s;
    if (tail_ >= half_blocks_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the NVMe index is full: ", entries_.size(), " persistent chunks fill its ",
                       capacity_records(), " records; raise nvme.index_size"));
    }
  }
  AlignedBuffer block(block_, block_);
  Encode(type, entry, generation_, block.data());
  if (absl::Status s = region_->WriteAt(HalfOffset(active_) + tail_ * block_, block.data(), block_);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = region_->Sync(); !s.ok()) return s;
  ++tail_;
  Apply(type, entry);
  return absl::OkStatus();
}

absl::Status NvmeIndex::Put(const IndexEntry& entry) {
  if (entry.name.empty() || entry.name.size() > kMaxName) {
    return absl::InvalidArgumentError("NVMe index: a persistent chunk needs a name of 1-255 bytes");
  }
  return Append(kPut, entry);
}

absl::Status NvmeIndex::Remove(uint32_t tenant, const std::string& name) {
  if (!entries_.contains(Key(tenant, name))) return absl::OkStatus();
  return Append(kRemove, IndexEntry{tenant, name});
}

absl::Status NvmeIndex::Compact() {
  const int target = 1 - active_;
  const uint64_t next_generation = generation_ + 1;
  if (entries_.size() + 1 >= half_blocks_) return absl::OkStatus();  // cannot shrink: caller fails
  // The live entries, written in pieces of up to 1 MiB (a few writes, not one per entry).
  const uint64_t piece_blocks = std::max<uint64_t>(1, (1 << 20) / block_);
  AlignedBuffer piece(piece_blocks * block_, block_);
  uint64_t pos = 1, filled = 0;
  auto flush = [&]() -> absl::Status {
    if (filled == 0) return absl::OkStatus();
    absl::Status s = region_->WriteAt(HalfOffset(target) + (pos - filled) * block_, piece.data(),
                                      filled * block_);
    filled = 0;
    return s;
  };
  for (const auto& [key, entry] : entries_) {
    Encode(kPut, entry, next_generation, piece.data() + filled * block_);
    ++filled;
    ++pos;
    if (filled == piece_blocks) {
      if (absl::Status s = flush(); !s.ok()) return s;
    }
  }
  if (absl::Status s = flush(); !s.ok()) return s;
  // Records carry their generation: older ones left in the target half are ignored on replay.
  if (absl::Status s = region_->Sync(); !s.ok()) return s;
  if (absl::Status s = WriteHeader(target, next_generation); !s.ok()) return s;
  active_ = target;
  generation_ = next_generation;
  tail_ = pos;
  spdlog::info("NVMe index compacted: generation {}, {} live records", generation_,
               entries_.size());
  return absl::OkStatus();
}

}  // namespace tierd::daemon
