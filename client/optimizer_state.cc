#include "client/optimizer_state.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace tierd::internal {

Shard ShardOf(uint64_t first, uint64_t n, ScalarType state_type, ParamGroup::Master master) {
  const uint64_t moment_bytes = (StateBytesPerParam(state_type) - 4) / 2;
  return {.first = first,
          .n = n,
          .p_region = master == ParamGroup::Master::kState ? RoundUp(n * 4, kPage) : 0,
          .mv_region = RoundUp(n * moment_bytes, kPage)};
}

// The parts of `g`'s tensors in shard `s` that `flags` marks (any bit), in order.
std::vector<Piece> PiecesOf(const Group& g, const Shard& s, std::span<const uint8_t> flags) {
  std::vector<Piece> pieces;
  const uint64_t lo = s.first, hi = s.first + s.n;
  auto it = std::upper_bound(g.tensor_first.begin(), g.tensor_first.end(), lo);
  size_t t =
      it == g.tensor_first.begin() ? 0 : static_cast<size_t>(it - g.tensor_first.begin()) - 1;
  for (; t < g.tensor_first.size() && g.tensor_first[t] < hi; ++t) {
    const uint64_t begin = std::max(lo, g.tensor_first[t]);
    const uint64_t end = std::min(hi, g.tensor_first[t] + g.spec.tensors[t]);
    if (begin < end && flags[t] != 0) pieces.push_back({t, begin - lo, end - lo, flags[t]});
  }
  return pieces;
}

namespace {

constexpr size_t kMaxGroupName = kMaxMetaGroupName;
constexpr size_t kMaxTensorsPerGroup = 1 << 20;

absl::Status ValidateGroupName(const std::string& name) {
  if (name.empty() || name.size() >= kMaxGroupName) {
    return absl::InvalidArgumentError(
        absl::StrCat("group name '", name, "' must be 1 to ", kMaxGroupName - 1, " bytes"));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          "group name '", name, "' has a character outside letters, digits and '._-'"));
    }
  }
  if (name == "." || name == ".." || name == "meta") {
    return absl::InvalidArgumentError(absl::StrCat("group name '", name, "' is reserved"));
  }
  return absl::OkStatus();
}

// A group's name, and its tensors (filled in as one tensor of all its parameters when not given).
absl::Status ValidateGroup(ParamGroup& g) {
  if (absl::Status s = ValidateGroupName(g.name); !s.ok()) return s;
  if (g.tensors.empty()) g.tensors = {g.params};
  uint64_t sum = 0;
  for (uint64_t n : g.tensors) {
    if (n > g.params - sum) break;
    sum += n;
  }
  if (sum != g.params) {
    return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "': its ", g.tensors.size(),
                                                   " tensors' sizes do not add up to its ",
                                                   g.params, " parameters"));
  }
  if (g.tensors.size() > kMaxTensorsPerGroup) {
    return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "' has ", g.tensors.size(),
                                                   " tensors; at most ", kMaxTensorsPerGroup));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGroups(std::vector<ParamGroup>& specs, const std::vector<Group>& existing,
                            bool persistent) {
  absl::flat_hash_set<std::string> names;
  for (const Group& g : existing) names.insert(g.spec.name);
  for (ParamGroup& g : specs) {
    if (absl::Status s = ValidateGroup(g); !s.ok()) return s;
    if (g.master != ParamGroup::Master::kState && g.master != ParamGroup::Master::kOut) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g.name, "': master ", static_cast<int>(g.master), " is not kState or kOut"));
    }
    if (g.master == ParamGroup::Master::kOut && persistent) {
      return absl::InvalidArgumentError(
          absl::StrCat("group '", g.name,
                       "': its master weights are its out, which persistent state cannot "
                       "restore on resuming: keep them in the state, or make the state scratch"));
    }
    if (!names.insert(g.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("group name '", g.name, "' appears twice"));
    }
  }
  return absl::OkStatus();
}

StateRecord::~StateRecord() {
  for (const auto& [id, data] : kept) (void)client->Release({&id, 1});
}

std::string StateRecord::ShardName(const std::string& group, size_t s, uint32_t version) const {
  return absl::StrCat(options.name, "/", group, "/", s, version == 1 ? ".1" : "");
}

absl::Status StateRecord::Unkeep(ChunkId id) {
  auto it = kept.find(id);
  if (it == kept.end()) return absl::OkStatus();
  kept.erase(it);
  return client->Release({&id, 1});
}

absl::StatusOr<void*> StateRecord::Pin(ChunkId id, AccessMode mode,
                                       const std::function<absl::Status()>& between) {
  absl::StatusOr<Acquired> a = client->AcquireIds({&id, 1}, Tier::kHost, mode);
  if (!a.ok()) return a.status();
  absl::Status s;
  for (;;) {
    if (between) {
      if (s = between(); !s.ok()) {
        client->Abandon(a->ready);
        break;
      }
    }
    s = client->Wait(a->ready, between ? absl::Milliseconds(1) : absl::InfiniteDuration());
    if (!between || !absl::IsDeadlineExceeded(s)) break;
    // The wait timed out, unless the request itself failed so; waiting again tells which.
    if (!absl::IsUnavailable(client->Poll(a->ready))) {
      s = client->Wait(a->ready);
      break;
    }
  }
  if (!s.ok()) {
    (void)client->Release({&id, 1});
    return s;
  }
  return a->chunks[0].data;
}

absl::StatusOr<void*> StateRecord::Keep(ChunkId id) {
  if (auto it = kept.find(id); it != kept.end()) return it->second;
  absl::StatusOr<void*> data = Pin(id, AccessMode::kWrite);
  if (data.ok()) kept.emplace(id, *data);
  return data;
}

std::string StateRecord::MetaName(uint64_t generation) const {
  return absl::StrCat(options.name, "/meta", generation % 2 == 1 ? ".1" : "");
}

MetaRecord StateRecord::Record(bool step_running) const {
  MetaRecord r{.shard_params = shard_params,
               .steps = steps,
               .in_step = !step_running         ? kNoStep
                          : options.speculative ? kSpeculativeStep
                                                : kInPlaceStep,
               .state_type = static_cast<uint32_t>(options.state_type),
               .generation = meta_generation};
  for (const Group& g : groups) {
    MetaGroupRecord& out = r.groups.emplace_back();
    out.name = g.spec.name;
    out.params = g.spec.params;
    out.initialized = g.initialized;
    out.tensors = g.spec.tensors;
    out.tensor_steps = g.tensor_steps;
    for (const Shard& sh : g.shards) out.shard_versions.push_back(sh.version);
  }
  for (const Recorded& d : dormant) r.groups.push_back(d.record);
  return r;
}

absl::Status StateRecord::WriteMetaTo(ChunkId id, uint64_t size, const MetaRecord& record) {
  absl::StatusOr<void*> data = Pin(id, AccessMode::kOverwrite);
  if (!data.ok()) return data.status();
  EncodeMeta(record, {static_cast<char*>(*data), size});
  if (absl::Status s = client->Release({&id, 1}); !s.ok()) return s;
  if (!nvme_home()) return absl::OkStatus();
  absl::StatusOr<CompletionToken> t = client->EvictIds({&id, 1}, Tier::kNvme, true);
  if (!t.ok()) return t.status();
  return client->Wait(*t);
}

absl::Status StateRecord::WriteMeta(bool step_running) {
  if (!options.persistent) return absl::OkStatus();
  MetaRecord record = Record(step_running);
  const uint64_t bytes = EncodedMetaSize(record);
  if (bytes <= meta_size) return WriteMetaTo(meta, meta_size, record);
  record.generation = meta_generation + 1;
  const uint64_t size = RoundUp(bytes, kPage);
  absl::StatusOr<std::vector<ChunkId>> grown =
      client->AllocateIds(std::vector<ChunkSpec>{{.size = size,
                                                  .home = options.home,
                                                  .name = MetaName(record.generation),
                                                  .persistent = true}});
  if (!grown.ok()) return grown.status();
  if (absl::Status s = WriteMetaTo((*grown)[0], size, record); !s.ok()) {
    (void)client->Free(*grown);
    return s;
  }
  const ChunkId old = meta;
  meta = (*grown)[0];
  meta_size = size;
  meta_generation = record.generation;
  return client->Free({&old, 1});
}

void StateRecord::LayOut(Group& group) const {
  group.tensor_first.clear();
  uint64_t first = 0;
  for (uint64_t n : group.spec.tensors) {
    group.tensor_first.push_back(first);
    first += n;
  }
  group.tensor_steps.resize(group.spec.tensors.size(), 0);
  group.shards.clear();
  for (uint64_t at = 0; at < group.spec.params; at += shard_params) {
    group.shards.push_back(ShardOf(at, std::min(shard_params, group.spec.params - at),
                                   options.state_type, group.spec.master));
  }
}

void StateRecord::SpecifyChunks(size_t g, bool resuming,
                                std::vector<ChunkSpec>* chunk_specs) const {
  const Group& group = groups[g];
  for (size_t k = 0; k < group.shards.size(); ++k) {
    const Shard& s = group.shards[k];
    ChunkSpec spec{.size = s.bytes(), .home = options.home};
    if (options.persistent) {
      spec.name = ShardName(g, k, s.version);
      spec.persistent = true;
      spec.open_existing = resuming;
      spec.must_exist = resuming;  // never a fresh zeroed one
    }
    spec.tags = {"optimizer"};
    if (options.speculative) {  // the other version: whatever it holds is overwritten
      ChunkSpec other = spec;
      if (options.persistent) {
        other.name = ShardName(g, k, s.version ^ 1);
        other.open_existing = true;
        other.must_exist = false;
      }
      chunk_specs->push_back(std::move(other));
    }
    chunk_specs->push_back(std::move(spec));
  }
}

void StateRecord::AssignChunks(Group& group, const std::vector<ChunkId>& ids, size_t* next) const {
  for (Shard& s : group.shards) {
    if (options.speculative) s.other = ids[(*next)++];
    s.id = ids[(*next)++];
  }
}

absl::Status StateRecord::Lost(const absl::Status& s) const {
  if (!absl::IsDataLoss(s)) return s;
  return absl::DataLossError(absl::StrCat("optimizer state '", options.name, "': ", s.message(),
                                          " (reset starts afresh; a checkpoint resumes)"));
}

namespace {

// NAME for a sharded state's NAME.rank<r>of<n>; the name itself otherwise.
absl::string_view JobName(absl::string_view state) {
  const size_t dot = state.rfind(".rank");
  if (dot == absl::string_view::npos) return state;
  const absl::string_view suffix = state.substr(dot + 5);
  const size_t of = suffix.find("of");
  const auto digits = [](absl::string_view d) {
    return !d.empty() && std::all_of(d.begin(), d.end(), absl::ascii_isdigit);
  };
  if (of == absl::string_view::npos || !digits(suffix.substr(0, of)) ||
      !digits(suffix.substr(of + 2))) {
    return state;
  }
  return state.substr(0, dot);
}

}  // namespace

std::string StateRecord::OtherShares(const std::vector<ChunkInfo>& all) const {
  const absl::string_view job = JobName(options.name);
  std::set<std::string> shares;
  for (const ChunkInfo& c : all) {
    if (!c.persistent) continue;
    absl::string_view name = c.name;
    if (!absl::ConsumeSuffix(&name, "/meta") && !absl::ConsumeSuffix(&name, "/meta.1")) continue;
    if (name != options.name && JobName(name) == job) shares.insert(absl::StrCat("'", name, "'"));
  }
  if (shares.empty()) return "";
  return absl::StrCat(" (this daemon holds ", absl::StrJoin(shares, ", "),
                      ": the same job's state, made by ranks that ran here)");
}

absl::Status StateRecord::Open() {
  const std::string prefix = options.name + "/";
  const std::string what = absl::StrCat("optimizer state '", options.name, "'");

  // Persistent state of this name: resume it (or discard it when asked to). The meta chunk is
  // under one of two names (it is replaced by a larger one under the other when groups are added);
  // a crash while it was replaced leaves both, and the later generation is the state's.
  std::vector<ChunkInfo> prefixed;
  std::optional<MetaRecord> found;
  if (options.persistent) {
    absl::StatusOr<std::vector<ChunkInfo>> all = client->ListChunks();
    if (!all.ok()) return all.status();
    std::vector<const ChunkInfo*> metas;
    for (const ChunkInfo& c : *all) {
      if (!c.persistent || !absl::StartsWith(c.name, prefix)) continue;
      prefixed.push_back(c);
    }
    for (const ChunkInfo& c : prefixed) {
      if (c.name == MetaName(0) || c.name == MetaName(1)) metas.push_back(&c);
    }
    if (options.open == OffloadedAdamOptions::Open::kOpen && metas.empty()) {
      return absl::NotFoundError(
          absl::StrCat(what, " does not exist: nothing to resume", OtherShares(*all)));
    }
    if (options.open == OffloadedAdamOptions::Open::kCreate && !metas.empty() && !options.reset) {
      return absl::AlreadyExistsError(
          absl::StrCat(what, " exists already: open it to resume, or reset it to start afresh"));
    }
    if (!options.reset) {
      absl::Status first_error;
      for (const ChunkInfo* c : metas) {
        absl::StatusOr<std::vector<ChunkId>> opened =
            client->AllocateIds(std::vector<ChunkSpec>{{.size = c->size,
                                                        .home = options.home,
                                                        .name = c->name,
                                                        .persistent = true,
                                                        .open_existing = true,
                                                        .must_exist = true}});
        if (!opened.ok()) return Lost(opened.status());
        const ChunkId id = (*opened)[0];
        absl::StatusOr<void*> data = Pin(id, AccessMode::kRead);
        if (!data.ok()) return data.status();
        absl::StatusOr<MetaRecord> record = DecodeMeta({static_cast<const char*>(*data), c->size});
        (void)client->Release({&id, 1});
        if (!record.ok()) {
          if (first_error.ok()) first_error = record.status();
          continue;
        }
        if (!found.has_value() || record->generation > found->generation) {
          found = std::move(*record);
          meta = id;
          meta_size = c->size;
          meta_generation = found->generation;
        }
      }
      if (!found.has_value() && !first_error.ok()) {
        return absl::DataLossError(
            absl::StrCat(what, ": ", first_error.message(), " (set reset to start afresh)"));
      }
    }
  }

  std::vector<Recorded> recorded;
  if (found.has_value()) {
    if (absl::Status s = MatchState(*found, what); !s.ok()) return s;
    // A speculative step wrote only the versions that were not yet the state: stopped during
    // one, the state is that of the step before.
    if (found->in_step == kInPlaceStep) {
      return absl::DataLossError(absl::StrCat(
          what, ": step ", found->steps + 1,
          " did not finish (the process or daemon stopped during it), so the state is partly "
          "updated; resume from a checkpoint, or set reset to start afresh"));
    }
    shard_params = found->shard_params;
    steps = found->steps;
    resumed = true;
    for (internal::MetaGroupRecord& r : found->groups) {
      recorded.push_back({std::move(r), found->tensors_known()});
      if (found->tensors_known()) continue;
      // Format 1: one tensor at the steps taken, one version for every shard.
      internal::MetaGroupRecord& old = recorded.back().record;
      old.tensors = {old.params};
      old.tensor_steps = {found->steps};
      old.shard_versions.resize((old.params + shard_params - 1) / shard_params,
                                old.shard_versions.empty() ? 0 : old.shard_versions[0]);
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    LayOut(groups[g]);
    if (!found.has_value()) continue;
    auto r = std::find_if(recorded.begin(), recorded.end(),
                          [&](const Recorded& x) { return x.record.name == groups[g].spec.name; });
    if (r == recorded.end()) {
      std::vector<std::string> names;
      for (const Recorded& x : recorded) names.push_back(x.record.name);
      return absl::FailedPreconditionError(absl::StrCat(what, " has no group '",
                                                        groups[g].spec.name, "': its groups are ",
                                                        absl::StrJoin(names, ", ")));
    }
    if (absl::Status s = Adopt(groups[g], *r, what); !s.ok()) return s;
    recorded.erase(r);
  }
  dormant = std::move(recorded);

  // Chunks under the name that are not the state: all of them on reset, or when no meta chunk
  // was written (a Create that stopped before it); else those of groups that are gone (a stop
  // while groups were added or removed) and a meta chunk that was replaced.
  std::vector<ChunkId> stale;
  absl::flat_hash_set<std::string> wanted;
  if (found.has_value()) {
    wanted.insert(MetaName(meta_generation));
    for (const Group& g : groups) {
      for (size_t k = 0; k < g.shards.size(); ++k) {
        wanted.insert(ShardName(g.spec.name, k, 0));
        wanted.insert(ShardName(g.spec.name, k, 1));
      }
    }
    for (const Recorded& d : dormant) {
      for (size_t k = 0; k < d.record.shard_versions.size(); ++k) {
        wanted.insert(ShardName(d.record.name, k, 0));
        wanted.insert(ShardName(d.record.name, k, 1));
      }
    }
  }
  for (const ChunkInfo& c : prefixed) {
    if (!wanted.contains(c.name) && c.id != meta) stale.push_back(c.id);
  }
  if (!stale.empty()) {
    if (absl::Status s = client->Free(stale); !s.ok()) return s;
  }

  // Allocate (or open) the shards' chunks, and the meta chunk of new persistent state.
  std::vector<ChunkSpec> chunk_specs;
  for (size_t g = 0; g < groups.size(); ++g) SpecifyChunks(g, resumed, &chunk_specs);
  if (options.persistent && meta == 0) {
    meta_size = RoundUp(EncodedMetaSize(Record(false)), kPage);
    chunk_specs.push_back(
        {.size = meta_size, .home = options.home, .name = MetaName(0), .persistent = true});
  }
  absl::StatusOr<std::vector<ChunkId>> ids = client->AllocateIds(chunk_specs);
  if (!ids.ok()) return Lost(ids.status());
  size_t i = 0;
  for (Group& group : groups) AssignChunks(group, *ids, &i);
  if (options.persistent && !resumed) {
    meta = (*ids)[i];
    if (absl::Status s = WriteMeta(false); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status StateRecord::MatchState(const MetaRecord& found, const std::string& what) const {
  if (found.state_type != static_cast<uint32_t>(options.state_type)) {
    auto type_name = [](uint32_t t) {
      return t == static_cast<uint32_t>(ScalarType::kFloat32)    ? "float32"
             : t == static_cast<uint32_t>(ScalarType::kBFloat16) ? "bfloat16"
                                                                 : "an unknown type";
    };
    return absl::FailedPreconditionError(
        absl::StrCat(what, " keeps m and v in ", type_name(found.state_type), ", not in ",
                     type_name(static_cast<uint32_t>(options.state_type)),
                     ": open it with the state type it was created with"));
  }
  if (options.shard_params != 0 && options.shard_params != found.shard_params) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " has ", found.shard_params, " parameters per shard, not ", options.shard_params));
  }
  return absl::OkStatus();
}

absl::Status StateRecord::Adopt(Group& group, const Recorded& recorded,
                                const std::string& what) const {
  const internal::MetaGroupRecord& r = recorded.record;
  if (r.params != group.spec.params || (recorded.split_known && r.tensors != group.spec.tensors)) {
    auto tensors = [](size_t n) { return absl::StrCat(n, n == 1 ? " tensor" : " tensors"); };
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": group '", group.spec.name, "' of ", r.params, " parameters in ",
                     tensors(r.tensors.size()), ", not of ", group.spec.params, " in ",
                     tensors(group.spec.tensors.size())));
  }
  if (r.shard_versions.size() != group.shards.size()) {
    return absl::DataLossError(absl::StrCat(what, ": group '", group.spec.name, "' records ",
                                            r.shard_versions.size(), " shards, not ",
                                            group.shards.size(), " (set reset to start afresh)"));
  }
  group.initialized = r.initialized;
  if (recorded.split_known) {
    group.tensor_steps = r.tensor_steps;
  } else {
    group.tensor_steps.assign(group.spec.tensors.size(), r.tensor_steps[0]);
  }
  for (size_t k = 0; k < group.shards.size(); ++k) group.shards[k].version = r.shard_versions[k];
  return absl::OkStatus();
}

}  // namespace tierd::internal
