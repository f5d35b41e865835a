// A record of the index of persistent chunks: where a persistent chunk's durable version is. The
// NVMe tier keeps the index (nvme/nvme_index.h); the chunk layer writes records through the
// PersistentIndex seam (hop.h).
#pragma once

#include <cstdint>
#include <string>

namespace tierd::daemon {

struct IndexEntry {
  uint32_t tenant = 0;
  std::string name;
  uint64_t chunk_size = 0;
  uint64_t offset = 0;    // logical offset in the striped volume
  uint64_t reserved = 0;  // bytes reserved there; 0: the chunk has no copy on NVMe
  uint64_t checksum = 0;  // XXH3-64 of the chunk's bytes
  // The chunk lives in memory (its home is the host or device tier): NVMe holds it only from a
  // clean stop, or an explicit eviction, until it is next written.
  bool memory_home = false;
  // The current version is in memory, not at `offset`: a daemon that restarts from this record
  // stopped without writing it down, and the chunk is lost.
  bool in_memory = false;
};

}  // namespace tierd::daemon
