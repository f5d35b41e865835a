// tierd-bench nvme: chunks moved between the host tier and NVMe through the whole stack, beside
// fio on the same file system, and what the drive was asked for by each (bench/nvme.cc).
#pragma once

#include <cstdint>
#include <string>

namespace tierd::bench {

struct NvmeOptions {
  // Flags tierd-bench's modes share, whose defaults are its own (bench/tierd_bench.cc).
  bool json = false;
  std::string dir;     // where the region and fio's file go
  uint64_t total = 0;  // bytes moved per measurement
  // The nvme mode's own.
  uint64_t io_size = 1 << 20;
  uint32_t queue_depth = 32;
  std::string huge_pages = "auto";  // the host tier's pages (the daemon's host.huge_pages)
  bool tune = false;                // sweep I/O size x queue depth instead
};

int Nvme(const NvmeOptions& o);

}  // namespace tierd::bench
