// The out-of-core optimizer's meta chunk ("<name>/meta", or "<name>/meta.1" after it grew): what
// its persistent state is — the groups, their tensors and each tensor's step count, which version
// of each shard holds the state — and whether a step is running. Written durably at each step's
// start and end (optimizer.cc); this file only encodes and decodes it, so that every byte read
// back is checked here before the optimizer trusts it.
//
// Version 2 (little-endian, as written by this library):
//   Header | Counts | Group[groups] | Tensor[counts.tensors] | uint8 version[counts.shards]
// Version 1 (earlier releases) had one version per group and no tensors: it decodes with
// `tensors_known` false, every tensor at the header's step count.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tierd::internal {

// MetaRecord::in_step: no step running; a step rewriting the state in place (interrupted, the
// state is partly updated); a speculative one writing other versions only (interrupted, the state
// is that of the step before).
inline constexpr uint32_t kNoStep = 0;
inline constexpr uint32_t kInPlaceStep = 1;
inline constexpr uint32_t kSpeculativeStep = 2;
inline constexpr size_t kMaxMetaGroupName = 64;  // bytes, the terminating zero included

struct MetaGroupRecord {
  std::string name;
  uint64_t params = 0;
  bool initialized = false;
  std::vector<uint64_t> tensors;      // sizes; version 1: empty (not recorded)
  std::vector<int64_t> tensor_steps;  // one per tensor; version 1: empty
  // One per shard, in order (0: "<shard>", 1: "<shard>.1"); version 1: one value for all.
  std::vector<uint8_t> shard_versions;
};

struct MetaRecord {
  uint32_t format = 2;  // the version it was decoded from
  uint64_t shard_params = 0;
  int64_t steps = 0;  // steps finished, counting across resumptions
  uint32_t in_step = kNoStep;
  uint32_t state_type = 0;  // ScalarType of m and v
  uint64_t generation = 0;  // grows by one each time the chunk is replaced by a larger one
  std::vector<MetaGroupRecord> groups;
  bool tensors_known() const { return format >= 2; }
};

// Bytes the record takes encoded (version 2).
uint64_t EncodedMetaSize(const MetaRecord& record);
// Writes the record (version 2) into `out`, which holds at least EncodedMetaSize bytes; the rest
// of `out` is zeroed. REQUIRES: group names shorter than kMaxMetaGroupName.
void EncodeMeta(const MetaRecord& record, std::span<char> out);
// DATA_LOSS, saying what is wrong, for bytes that are not a meta chunk this library wrote (or
// one a newer library wrote) or whose counts do not add up.
absl::StatusOr<MetaRecord> DecodeMeta(std::span<const char> bytes);

}  // namespace tierd::internal
