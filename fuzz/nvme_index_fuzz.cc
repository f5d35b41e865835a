// The index of persistent chunks: a fresh index is written by a program the input spells — puts
// of overlapping extents, removes, replays, and corruption of any byte of the index area — and
// every replay must hold: without corruption it gives back exactly the entries written, and with
// any it never crashes and never yields two entries whose extents overlap.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/tiers/nvme/nvme_index.h"
#include "daemon/tiers/nvme/nvme_region.h"
#include "fuzz/scratch_dir.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kIndexOffset = kRegionHeaderBytes;
constexpr uint64_t kIndexBytes = 64 << 10;

NvmeRegion* Region() {
  static NvmeRegion* region = [] {
    spdlog::set_level(spdlog::level::off);
    const std::string dir = FuzzScratchDir("/var/tmp", "index");
    auto r =
        NvmeRegion::Open({absl::StrCat(dir, "/region"), kIndexOffset + kIndexBytes + (1 << 20)});
    if (!r.ok()) abort();
    AttachOwnEngine(**r).release();  // lives as long as the region: the whole run
    return r->release();
  }();
  return region;
}

// Reads bytes of the input as operands; zeros once it runs out.
struct Input {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  bool done() const { return pos >= size; }
  uint32_t Byte() { return pos < size ? data[pos++] : 0; }
  uint32_t Word() { return Byte() | (Byte() << 8); }
};

bool Overlapping(const NvmeIndex& index) {
  std::map<uint64_t, uint64_t> extents;  // offset -> end
  for (const auto& [key, e] : index.entries()) {
    if (key != NvmeIndex::Key(e.tenant, e.name) || e.name.empty() || e.name.size() > 255) {
      return true;
    }
    if (e.reserved == 0) continue;
    auto [it, fresh] = extents.emplace(e.offset, e.offset + e.reserved);
    if (!fresh) return true;
    if (it != extents.begin() && std::prev(it)->second > e.offset) return true;
    if (std::next(it) != extents.end() && std::next(it)->first < it->second) return true;
  }
  return false;
}

}  // namespace
}  // namespace tierd::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tierd;
  using namespace tierd::daemon;
  NvmeRegion* region = Region();
  auto opened = NvmeIndex::Open(region, kIndexOffset, kIndexBytes, /*fresh=*/true);
  if (!opened.ok()) abort();
  std::unique_ptr<NvmeIndex> index = std::move(*opened);
  const uint32_t block = region->block_size();
  const uint64_t blocks = kIndexBytes / block;
  bool corrupted = false;
  Input in{data, size};
  while (!in.done() && index != nullptr) {
    switch (in.Byte() % 4) {
      case 0: {  // put: a name, a size and an extent that may overlap others
        const uint32_t id = in.Byte();
        IndexEntry e{in.Byte() % 3,
                     absl::StrCat("job/", id % 24),
                     (in.Byte() + 1) * 4096ull,
                     (in.Byte() % 64) * (16ull << 10),
                     0,
                     in.Word()};
        e.reserved = (e.chunk_size + 4095) / 4096 * 4096;
        (void)index->Put(e);
        break;
      }
      case 1:  // remove
        (void)index->Remove(in.Byte() % 3, absl::StrCat("job/", in.Byte() % 24));
        break;
      case 2: {  // the daemon restarts: replay
        const auto before = index->entries();
        auto replayed = NvmeIndex::Open(region, kIndexOffset, kIndexBytes, /*fresh=*/false);
        if (!replayed.ok()) {
          if (!corrupted) __builtin_trap();  // an intact index always replays
          index.reset();
          break;
        }
        index = std::move(*replayed);
        if (Overlapping(*index)) __builtin_trap();
        if (!corrupted && index->entries().size() != before.size()) __builtin_trap();
        if (!corrupted) {
          for (const auto& [key, e] : before) {
            auto it = index->entries().find(key);
            if (it == index->entries().end() || it->second.offset != e.offset ||
                it->second.chunk_size != e.chunk_size || it->second.checksum != e.checksum) {
              __builtin_trap();
            }
          }
        }
        break;
      }
      case 3: {  // a byte of the index area changes on the drive
        const uint64_t b = in.Word() % blocks;
        const uint32_t at = in.Word() % block;
        const uint8_t flip = static_cast<uint8_t>(in.Byte() | 1);
        AlignedBuffer buf(block, block);
        if (!region->ReadAt(kIndexOffset + b * block, buf.data(), block).ok()) abort();
        buf.data()[at] ^= flip;
        if (!region->WriteAt(kIndexOffset + b * block, buf.data(), block).ok()) abort();
        corrupted = true;
        break;
      }
    }
  }
  return 0;
}
