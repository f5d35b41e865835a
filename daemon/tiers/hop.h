// How a chunk's bytes cross from one tier to the next. Each hop is done by the part that owns the
// hardware it crosses: the NVMe tier reads chunks into host memory and writes them back, the GPU
// copies to and from its memory. The chunk service moves chunks along routes of hops and knows
// them only through this interface, as it knows the tiers only through Tier.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "daemon/io/io_engine.h"
#include "daemon/tiers/index_entry.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

// One chunk's copy across one hop.
struct HopJob {
  uint64_t chunk_id = 0;  // for error messages
  Placement from, to;
  // The daemon's addresses of `from` and `to` where they are memory (Tier::Address); null on NVMe.
  void* from_address = nullptr;
  void* to_address = nullptr;
  uint64_t size = 0;  // bytes to copy, from the start of each placement
  // Reads from NVMe: the checksum the bytes must have (DATA_LOSS, naming the chunk, when they do
  // not). `zeros`: the source was never written, so the destination is filled with zeros.
  uint64_t checksum = 0;
  bool zeros = false;
  // Writes to NVMe: `durable` flushes before calling back; `commit` is then recorded in the index
  // of persistent chunks, with the checksum filled in, as the write's commit point.
  bool durable = false;
  std::optional<IndexEntry> commit;
  IoOrder order;  // where NVMe I/O goes in the engine's queue
};

// The part `[offset, offset + length)` of a job: the same placements and addresses moved on.
HopJob Slice(const HopJob& job, uint64_t offset, uint64_t length);

class Hop {
 public:
  // Runs once, never on the caller's thread. `checksum`: of the bytes written, where the hop
  // computes one (writes to NVMe); 0 elsewhere.
  using Done = std::function<void(absl::Status status, uint64_t checksum)>;
  using OnPiece = std::function<void(uint64_t offset, uint64_t length)>;

  virtual ~Hop() = default;
  virtual void Copy(const HopJob& job, Done done) = 0;
  // Copy, calling `on_piece(offset, length)` as each stretch of about `piece` bytes lands (on the
  // hop's thread; it must not block), so that the next hop of a route can carry it on before the
  // whole chunk is in; the last stretch may run past the job's size to the tier's block. `done`
  // follows the last piece. The default lands the chunk as one piece.
  virtual void CopyInPieces(const HopJob& job, uint64_t piece, OnPiece on_piece, Done done);
};

// Carries a chunk over two hops in a row, each piece of the first going on over the second as soon
// as it has landed (NVMe -> host -> GPU); `first.to` is `second.from`. `done` runs once, when
// every piece has settled on both hops, with the first error (if any) and the first hop's checksum.
void CopyAlong(Hop* first, const HopJob& first_job, Hop* second, const HopJob& second_job,
               uint64_t piece, Hop::Done done);

// The durable record of persistent chunks: what the NVMe tier's index is to the chunk service.
class PersistentIndex {
 public:
  virtual ~PersistentIndex() = default;
  // Records the chunk (durably), replacing any record of its name; `done` runs once, never on the
  // caller's thread.
  virtual void Persist(IndexEntry entry, std::function<void(absl::Status)> done) = 0;
  // Removes the record of the name, if any (errors are logged).
  virtual void Forget(uint32_t tenant, std::string name) = 0;
  // The least space a persistent chunk takes in the tier that holds the records.
  virtual uint64_t persistent_granule() const = 0;
  // Claims the space of a recovered persistent chunk. False if it overlaps another.
  virtual bool Claim(const Placement& placement) = 0;
};

class NvmeTier;
class Device;

// What the chunk service moves chunks with: the tiers by kind, the hop on each path and the index
// of persistent chunks, each null where the node has none.
struct Tiers {
  TierArray<Tier*> tier;
  PathArray<Hop*> hop;
  PersistentIndex* index = nullptr;
};

// A node's tiers and hops: the host tier (required), the NVMe tier with its reads, writes and
// index, the device pool with the GPU's copies; null parts are absent.
Tiers NodeTiers(Tier* host, NvmeTier* nvme = nullptr, Tier* device_pool = nullptr,
                Device* device = nullptr);

}  // namespace tierd::daemon
