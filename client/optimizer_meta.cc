#include "client/optimizer_meta.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace tierd::internal {
namespace {

constexpr uint64_t kMagic = 0x316d616472656974ull;  // "tierdam1"
constexpr uint32_t kFormat = 2;

// The start of every version.
struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t groups;
  uint64_t shard_params;
  int64_t steps;
  uint32_t in_step;
  uint32_t state_type;  // 0 (fp32) in state written before bf16 state existed
};
// Version 1's group record.
struct GroupV1 {
  uint64_t params;
  uint32_t initialized;
  uint32_t version;
  char name[kMaxMetaGroupName];
};
// Version 2: after the header.
struct Counts {
  uint64_t tensors;
  uint64_t shards;
  uint64_t generation;
};
struct Group {
  uint64_t params;
  uint64_t tensors;
  uint64_t shards;
  uint32_t initialized;
  uint32_t reserved;
  char name[kMaxMetaGroupName];
};
struct Tensor {
  uint64_t params;
  int64_t steps;
};

absl::Status Corrupt(absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("its meta chunk is not one this library wrote (", what, ")"));
}

// Reads a T at `*at` and moves past it; false when the bytes end first.
template <typename T>
bool Take(std::span<const char> bytes, uint64_t* at, T* out) {
  if (bytes.size() < *at || bytes.size() - *at < sizeof(T)) return false;
  std::memcpy(out, bytes.data() + *at, sizeof(T));
  *at += sizeof(T);
  return true;
}

std::string NameOf(const char (&name)[kMaxMetaGroupName]) {
  return std::string(name, strnlen(name, kMaxMetaGroupName));
}

}  // namespace

uint64_t EncodedMetaSize(const MetaRecord& r) {
  uint64_t tensors = 0, shards = 0;
  for (const MetaGroupRecord& g : r.groups) {
    tensors += g.tensors.size();
    shards += g.shard_versions.size();
  }
  return sizeof(Header) + sizeof(Counts) + r.groups.size() * sizeof(Group) +
         tensors * sizeof(Tensor) + shards;
}

void EncodeMeta(const MetaRecord& r, std::span<char> out) {
  std::memset(out.data(), 0, out.size());
  uint64_t at = 0;
  auto put = [&](const auto& value) {
    std::memcpy(out.data() + at, &value, sizeof(value));
    at += sizeof(value);
  };
  Counts counts{.generation = r.generation};
  for (const MetaGroupRecord& g : r.groups) {
    counts.tensors += g.tensors.size();
    counts.shards += g.shard_versions.size();
  }
  put(Header{.magic = kMagic,
             .version = kFormat,
             .groups = static_cast<uint32_t>(r.groups.size()),
             .shard_params = r.shard_params,
             .steps = r.steps,
             .in_step = r.in_step,
             .state_type = r.state_type});
  put(counts);
  for (const MetaGroupRecord& g : r.groups) {
    Group record{.params = g.params,
                 .tensors = g.tensors.size(),
                 .shards = g.shard_versions.size(),
                 .initialized = g.initialized ? 1u : 0u,
                 .reserved = 0,
                 .name = {}};
    std::memcpy(record.name, g.name.data(), std::min(g.name.size(), kMaxMetaGroupName - 1));
    put(record);
  }
  for (const MetaGroupRecord& g : r.groups) {
    for (size_t t = 0; t < g.tensors.size(); ++t) put(Tensor{g.tensors[t], g.tensor_steps[t]});
  }
  for (const MetaGroupRecord& g : r.groups) {
    for (uint8_t v : g.shard_versions) out[at++] = static_cast<char>(v);
  }
}

absl::StatusOr<MetaRecord> DecodeMeta(std::span<const char> bytes) {
  uint64_t at = 0;
  Header h;
  if (!Take(bytes, &at, &h) || h.magic != kMagic) return Corrupt("no header");
  if (h.version != 1 && h.version != kFormat) {
    return Corrupt(absl::StrCat("format version ", h.version, "; this library reads 1 and 2"));
  }
  MetaRecord r{.format = h.version,
               .shard_params = h.shard_params,
               .steps = h.steps,
               .in_step = h.in_step,
               .state_type = h.state_type};
  if (h.in_step != kNoStep && h.in_step != kInPlaceStep && h.in_step != kSpeculativeStep) {
    return Corrupt(absl::StrCat("step state ", h.in_step));
  }
  if (h.steps < 0 || h.shard_params == 0) return Corrupt("steps or shard size out of range");
  // Every record is bounded by the chunk's bytes, so a damaged count cannot make us allocate more.
  if (h.groups > bytes.size() / sizeof(GroupV1)) return Corrupt("more groups than bytes");
  if (h.version == 1) {
    for (uint32_t g = 0; g < h.groups; ++g) {
      GroupV1 v1;
      if (!Take(bytes, &at, &v1)) return Corrupt("truncated group records");
      if (v1.version > 1) return Corrupt(absl::StrCat("group version ", v1.version));
      r.groups.push_back({.name = NameOf(v1.name),
                          .params = v1.params,
                          .initialized = v1.initialized != 0,
                          .shard_versions = {static_cast<uint8_t>(v1.version)}});
    }
    return r;
  }
  Counts counts;
  if (!Take(bytes, &at, &counts)) return Corrupt("truncated counts");
  r.generation = counts.generation;
  if (counts.tensors > bytes.size() / sizeof(Tensor) || counts.shards > bytes.size()) {
    return Corrupt("more tensors or shards than bytes");
  }
  uint64_t tensors = 0, shards = 0;
  for (uint32_t g = 0; g < h.groups; ++g) {
    Group record;
    if (!Take(bytes, &at, &record)) return Corrupt("truncated group records");
    if (record.tensors > counts.tensors - tensors || record.shards > counts.shards - shards) {
      return Corrupt("group records that do not add up to the counts");
    }
    tensors += record.tensors;
    shards += record.shards;
    r.groups.push_back({.name = NameOf(record.name),
                        .params = record.params,
                        .initialized = record.initialized != 0});
    r.groups.back().tensors.resize(record.tensors);
    r.groups.back().tensor_steps.resize(record.tensors);
    r.groups.back().shard_versions.resize(record.shards);
  }
  if (tensors != counts.tensors || shards != counts.shards) {
    return Corrupt("group records that do not add up to the counts");
  }
  if (bytes.size() - at < counts.tensors * sizeof(Tensor) + counts.shards) {
    return Corrupt("truncated tensor or shard records");
  }
  for (MetaGroupRecord& g : r.groups) {
    uint64_t sum = 0;
    for (size_t t = 0; t < g.tensors.size(); ++t) {
      Tensor tensor;
      Take(bytes, &at, &tensor);
      if (tensor.steps < 0 || tensor.params > g.params - sum) {
        return Corrupt(absl::StrCat("tensor ", t, " of group '", g.name, "'"));
      }
      sum += tensor.params;
      g.tensors[t] = tensor.params;
      g.tensor_steps[t] = tensor.steps;
    }
    if (sum != g.params) return Corrupt(absl::StrCat("tensors of group '", g.name, "'"));
  }
  for (MetaGroupRecord& g : r.groups) {
    for (uint8_t& v : g.shard_versions) {
      Take(bytes, &at, &v);
      if (v > 1) return Corrupt(absl::StrCat("shard version ", v, " in group '", g.name, "'"));
    }
  }
  return r;
}

}  // namespace tierd::internal
