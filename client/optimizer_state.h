// The out-of-core optimizer's state record: its groups laid out as shards of daemon chunks, the
// meta chunk that records them (optimizer_meta.h), and how state is opened — created, resumed,
// adopted by a group added later — and kept. The step's coordinator (optimizer.cc) and its worker
// (optimizer_worker.h) use it; it calls only the client.
//
// Not thread-safe: the driving thread's between steps; while a step runs the worker writes the
// shards of the groups it steps (Shard::written) and `kept`, and the driving thread only reads.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "client/optimizer_meta.h"
#include "tierd/optimizer.hpp"

namespace tierd::internal {

inline constexpr uint64_t kPage = 4096;

inline uint64_t RoundUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Bytes of state per parameter: fp32 weights, and m and v of `state_type`.
inline uint64_t StateBytesPerParam(ScalarType state_type) {
  return state_type == ScalarType::kBFloat16 ? 8 : 12;
}

// A state chunk: parameters [first, first + n) of its group, laid out as three page-aligned
// regions: p (fp32; empty for a group whose master is its out), m and v (fp32 or bf16).
struct Shard {
  ChunkId id = 0;     // the chunk holding the state
  ChunkId other = 0;  // speculative: the other version's chunk, which a step writes
  uint64_t first = 0;
  uint64_t n = 0;
  uint64_t p_region = 0;   // bytes of p
  uint64_t mv_region = 0;  // bytes of each of m and v
  uint8_t version = 0;     // of the chunk `id` names: 0 "<name>/<group>/<shard>", 1 "...<shard>.1"
  bool written = false;    // this step wrote it (the worker's while a step runs)
  // Scratch state at home on NVMe: the shard stays in the host tier from one step to the next
  // (in the budget, pinned during its step only) instead of streaming through the window. Set
  // between steps only.
  bool resident = false;
  // Stepped on the device, the shard stays in the device tier from one step to the next
  // (OffloadedAdamOptions::device_budget_bytes) instead of going home after its step. Set
  // between steps only.
  bool stays_on_device = false;
  uint64_t bytes() const { return p_region + 2 * mv_region; }
  uint64_t offset(OffloadedAdam::Part part) const {
    return part == OffloadedAdam::Part::kParams ? 0
           : part == OffloadedAdam::Part::kM    ? p_region
                                                : p_region + mv_region;
  }
};

// The layout of a shard of parameters [first, first + n); `master` says whether it holds p.
Shard ShardOf(uint64_t first, uint64_t n, ScalarType state_type,
              ParamGroup::Master master = ParamGroup::Master::kState);

// How many shards of `shard` bytes `budget` bytes of the host tier hold, its segments of `segment`
// bytes (0: not known) each holding as many whole ones as fit: a chunk never spans two.
inline uint64_t HostSlots(uint64_t budget, uint64_t segment, uint64_t shard) {
  if (segment < shard) return budget / shard;
  return budget / segment * (segment / shard) + budget % segment / shard;
}

struct Group {
  ParamGroup spec;                     // spec.tensors always lists the tensors
  std::vector<uint64_t> tensor_first;  // where each tensor starts in the group
  std::vector<int64_t> tensor_steps;   // steps each tensor has taken (torch's "step")
  std::vector<Shard> shards;
  bool initialized = false;
  // Stepped by the device lane (OffloadedAdam::SetGroupPlace); changed between steps only.
  bool on_device = false;
  bool master_in_out() const { return spec.master == ParamGroup::Master::kOut; }
};

// A tensor's elements within one shard: [begin, end) counted from the shard's first.
struct Piece {
  size_t tensor;
  uint64_t begin;
  uint64_t end;
  uint8_t flags;
};

// The parts of `g`'s tensors in shard `s` that `flags` marks (any bit), in order.
std::vector<Piece> PiecesOf(const Group& g, const Shard& s, std::span<const uint8_t> flags);

// Groups to add beside `existing`, their tensors filled in (one tensor of all the parameters when
// none are given): valid names and sizes, each name once; a master in `out` only in scratch
// state (`persistent` false).
absl::Status ValidateGroups(std::vector<ParamGroup>& specs, const std::vector<Group>& existing,
                            bool persistent);

struct StateRecord {
  // A group the state records that this optimizer has not opened: Create was given fewer groups
  // (a run that adds groups later, as the first run did). Kept in the meta chunk with its chunks,
  // and resumed by an AddGroups of the same name.
  struct Recorded {
    MetaGroupRecord record;
    bool split_known = true;  // false for format 1, which did not record the tensors
  };

  ~StateRecord();  // releases what is kept

  OffloadedAdamOptions options;
  Client* client = nullptr;
  std::vector<Group> groups;
  std::vector<Recorded> dormant;
  uint64_t shard_params = 0;
  uint64_t state_bytes = 0;
  bool resumed = false;
  int64_t steps = 0;
  ChunkId meta = 0;
  uint64_t meta_size = 0;
  uint64_t meta_generation = 0;  // of the meta chunk: even "<name>/meta", odd "<name>/meta.1"
  // Host-home state: each shard pinned by its first step and kept until the optimizer is
  // destroyed, so a step makes no call to the daemon for it (an NVMe home streams its shards
  // through the budget instead: pinned and released each step).
  absl::flat_hash_map<ChunkId, void*> kept;

  bool nvme_home() const { return options.home == Tier::kNvme; }
  // Whether shard `s` goes down to NVMe and up again each step (else it stays in the host tier).
  bool streams(const Shard& s) const { return nvme_home() && !s.resident; }
  std::string ShardName(const std::string& group, size_t s, uint32_t version) const;
  std::string ShardName(size_t g, size_t s, uint32_t version) const {
    return ShardName(groups[g].spec.name, s, version);
  }

  // Opens (resumes) or creates the state of `groups`, whose specs are validated: finds and reads
  // the meta chunk, adopts each group's record, frees what is not the state, allocates (or opens)
  // every shard's chunks and records new persistent state.
  absl::Status Open();
  // Lays out `group`'s shards (their chunks not yet allocated) and its tensors' offsets.
  void LayOut(Group& group) const;
  // Takes a recorded group's state for `group` (laid out), when the record is of its size and
  // tensors.
  absl::Status Adopt(Group& group, const Recorded& recorded, const std::string& what) const;
  // The chunks of group g's shards, in `chunk_specs`: for each shard the other version first
  // (speculative), then the state's. Resuming, the state's must exist.
  void SpecifyChunks(size_t g, bool resuming, std::vector<ChunkSpec>* chunk_specs) const;
  // Takes the chunk ids SpecifyChunks asked for, from `*next` on.
  void AssignChunks(Group& group, const std::vector<ChunkId>& ids, size_t* next) const;
  // State at home in memory that the daemon lost in a crash: what the caller can do about it.
  absl::Status Lost(const absl::Status& s) const;

  // Pins one chunk on the host for `mode` and waits until its bytes are there. While it waits,
  // `between` runs every millisecond (the worker keeps its read-ahead going).
  absl::StatusOr<void*> Pin(ChunkId id, AccessMode mode,
                            const std::function<absl::Status()>& between = nullptr);
  // A host-home shard's bytes, pinned for writing the first time it is asked for and kept.
  absl::StatusOr<void*> Keep(ChunkId id);
  // Releases a kept shard (its group is removed); nothing when it is not kept.
  absl::Status Unkeep(ChunkId id);

  // Records the state in the meta chunk (persistent state only). When the record has outgrown
  // the chunk (groups were added), a larger one is written under the other meta name, one
  // generation on, before the old one is freed: a crash in between leaves both, and Open takes
  // the later generation.
  absl::Status WriteMeta(bool step_running);

 private:
  std::string MetaName(uint64_t generation) const;
  // What the meta chunk records of the state as it is now.
  MetaRecord Record(bool step_running) const;
  // Writes `record` into chunk `id` of `size` bytes, durably at an NVMe home.
  absl::Status WriteMetaTo(ChunkId id, uint64_t size, const MetaRecord& record);
  // Whether recorded state can be this optimizer's: the same type of moments and shard size.
  absl::Status MatchState(const MetaRecord& found, const std::string& what) const;
  // The states in `all` that are other shares of this state's job (NAME or NAME.rank<r>of<n> for
  // this state's NAME): where a job's state was made, for one that moved between nodes or changed
  // its number of ranks. Empty, or " (this daemon holds ...)".
  std::string OtherShares(const std::vector<ChunkInfo>& all) const;
};

}  // namespace tierd::internal
