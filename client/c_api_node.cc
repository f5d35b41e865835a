// The C ABI over tierd::Client's calls about the node and the session's place on it: schedules,
// version bits, the session's figures and bandwidth weight, shared bases, imports, and the
// tiers' usage. (Sessions, chunks and their views are c_api.cc.)
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "client/c_api_common.h"
#include "client/c_api_session.h"
#include "common/completion_page.h"
#include "tierd/client.h"
#include "tierd/client.hpp"

using tierd::c_abi::Done;
using tierd::c_abi::Fail;
using tierd::c_abi::Guard;
using tierd::c_abi::Ids;
using tierd::c_abi::Invalid;
using tierd::c_abi::Token;

extern "C" {

static_assert(TIERD_VERSION_BITS == tierd::kVersionBits);

tierd_status tierd_set_schedule(tierd_client* client, size_t n_steps, const size_t* step_lengths,
                                const tierd_chunk_id* ids, const int* tiers, const int* modes,
                                uint64_t host_quota_bytes, uint64_t device_quota_bytes) {
  return tierd_set_paired_schedule(client, n_steps, step_lengths, ids, nullptr, nullptr, tiers,
                                   modes, host_quota_bytes, device_quota_bytes);
}

tierd_status tierd_set_paired_schedule(tierd_client* client, size_t n_steps,
                                       const size_t* step_lengths, const tierd_chunk_id* ids,
                                       const tierd_chunk_id* others, const uint32_t* version_bits,
                                       const int* tiers, const int* modes,
                                       uint64_t host_quota_bytes, uint64_t device_quota_bytes) {
  if (client == nullptr || (n_steps > 0 && step_lengths == nullptr)) {
    return Invalid("tierd_set_schedule: NULL client or step_lengths");
  }
  size_t total = 0;
  for (size_t i = 0; i < n_steps; ++i) total += step_lengths[i];
  if (total > 0 && (ids == nullptr || tiers == nullptr || modes == nullptr)) {
    return Invalid("tierd_set_schedule: NULL ids, tiers or modes");
  }
  if ((others == nullptr) != (version_bits == nullptr)) {
    return Invalid(
        "tierd_set_paired_schedule: others and version_bits are both given or both NULL");
  }
  return Guard([&] {
    std::vector<tierd::ScheduleStep> steps(n_steps);
    size_t next = 0;
    for (size_t i = 0; i < n_steps; ++i) {
      steps[i].reserve(step_lengths[i]);
      for (size_t j = 0; j < step_lengths[i]; ++j, ++next) {
        if (tiers[next] < TIERD_TIER_HOST || tiers[next] > TIERD_TIER_DEVICE) {
          return Fail(absl::InvalidArgumentError(absl::StrCat(
              "tierd_set_schedule: access ", next, " names tier ", tiers[next], ", not a tier")));
        }
        if (modes[next] < TIERD_ACCESS_READ || modes[next] > TIERD_ACCESS_OVERWRITE) {
          return Fail(absl::InvalidArgumentError(absl::StrCat(
              "tierd_set_schedule: access ", next, " has mode ", modes[next],
              ", not TIERD_ACCESS_READ, TIERD_ACCESS_WRITE or TIERD_ACCESS_OVERWRITE")));
        }
        steps[i].push_back({.id = ids[next],
                            .tier = static_cast<tierd::Tier>(tiers[next]),
                            .mode = static_cast<tierd::AccessMode>(modes[next]),
                            .other = others == nullptr ? 0 : others[next],
                            .version_bit = version_bits == nullptr ? 0 : version_bits[next]});
      }
    }
    return Done(client->client->SetSchedule(
        steps, {.host_quota_bytes = host_quota_bytes, .device_quota_bytes = device_quota_bytes}));
  });
}

tierd_status tierd_trace_schedule(tierd_client* client, uint32_t steps_per_iteration,
                                  uint64_t host_quota_bytes, uint64_t device_quota_bytes) {
  if (client == nullptr) return Invalid("tierd_trace_schedule: NULL client");
  return Guard([&] {
    return Done(client->client->TraceSchedule(
        steps_per_iteration,
        {.host_quota_bytes = host_quota_bytes, .device_quota_bytes = device_quota_bytes}));
  });
}

tierd_status tierd_begin_step(tierd_client* client, uint64_t k) {
  if (client == nullptr) return Invalid("tierd_begin_step: NULL client");
  client->client->BeginStep(k);
  return TIERD_OK;
}

tierd_status tierd_set_version(tierd_client* client, uint32_t bit, int value) {
  if (client == nullptr) return Invalid("tierd_set_version: NULL client");
  return Done(client->client->SetVersion(bit, value != 0));
}

tierd_status tierd_session_stats_get(tierd_client* client, tierd_session_stats* out) {
  if (client == nullptr || out == nullptr) return Invalid("tierd_session_stats_get: NULL argument");
  return Guard([&] {
    absl::StatusOr<tierd::SessionStats> s = client->client->GetSessionStats();
    if (!s.ok()) return Fail(s.status());
    *out = tierd_session_stats{s->acquired_ready,
                               s->acquired_waited,
                               static_cast<uint64_t>(absl::ToInt64Nanoseconds(s->host_stall)),
                               static_cast<uint64_t>(absl::ToInt64Nanoseconds(s->device_stall)),
                               s->planner_fetches,
                               s->planner_drops,
                               s->planner_write_backs,
                               s->cursor,
                               s->schedule_steps,
                               s->tracing ? 1 : 0};
    return TIERD_OK;
  });
}

tierd_status tierd_set_bandwidth_weight(tierd_client* client, uint32_t weight) {
  if (client == nullptr) return Invalid("tierd_set_bandwidth_weight: NULL client");
  return Guard([&] { return Done(client->client->SetBandwidthWeight(weight)); });
}

struct tierd_base {
  tierd::OpenedBase opened;
  std::vector<uint64_t> sizes;
  std::vector<int> homes;
};

tierd_status tierd_base_open(tierd_client* client, const char* name,
                             const tierd_base_create* create, tierd_base** out,
                             tierd_base_info* info) {
  if (client == nullptr || name == nullptr || out == nullptr || info == nullptr) {
    return Invalid("tierd_base_open: NULL argument");
  }
  if (create != nullptr &&
      ((create->n_chunks > 0 && (create->sizes == nullptr || create->homes == nullptr)) ||
       (create->descriptor_len > 0 && create->descriptor == nullptr))) {
    return Invalid("tierd_base_open: NULL array in create");
  }
  return Guard([&] {
    tierd::BaseCreate spec;
    if (create != nullptr) {
      for (size_t i = 0; i < create->n_chunks; ++i) {
        spec.chunks.push_back({create->sizes[i], static_cast<tierd::Tier>(create->homes[i])});
      }
      spec.descriptor.assign(static_cast<const char*>(create->descriptor), create->descriptor_len);
      if (create->share_with_group) spec.share_with_group = create->group;
      spec.job_writable = create->job_writable != 0;
    }
    absl::StatusOr<tierd::OpenedBase> opened =
        client->client->OpenBase(name, create != nullptr ? &spec : nullptr);
    if (!opened.ok()) return Fail(opened.status());
    auto base = std::make_unique<tierd_base>();
    base->opened = std::move(*opened);
    for (const tierd::BaseChunkSpec& c : base->opened.chunks) {
      base->sizes.push_back(c.size_bytes);
      base->homes.push_back(static_cast<int>(c.home_tier));
    }
    const tierd::OpenedBase& b = base->opened;
    *info = tierd_base_info{b.created ? 1 : 0,   b.creator_uid,      b.chunk_ids.size(),
                            b.chunk_ids.data(),  base->sizes.data(), base->homes.data(),
                            b.descriptor.data(), b.descriptor.size()};
    *out = base.release();
    return TIERD_OK;
  });
}

void tierd_base_free(tierd_base* base) { delete base; }

tierd_status tierd_base_seal(tierd_client* client, const char* name, const void* descriptor,
                             size_t descriptor_len) {
  if (client == nullptr || name == nullptr || (descriptor == nullptr && descriptor_len > 0)) {
    return Invalid("tierd_base_seal: NULL argument");
  }
  return Guard([&] {
    return Done(client->client->SealBase(
        name, std::string(static_cast<const char*>(descriptor), descriptor_len)));
  });
}

tierd_status tierd_base_release(tierd_client* client, const char* name) {
  if (client == nullptr || name == nullptr) return Invalid("tierd_base_release: NULL argument");
  return Guard([&] { return Done(client->client->ReleaseBase(name)); });
}

tierd_status tierd_base_pin(tierd_client* client, const char* name, int pinned) {
  if (client == nullptr || name == nullptr) return Invalid("tierd_base_pin: NULL argument");
  return Guard([&] { return Done(client->client->PinBase(name, pinned != 0)); });
}

tierd_status tierd_import(tierd_client* client, tierd_chunk_id id, int fd, uint64_t file_size,
                          int64_t file_mtime_ns, size_t n, const tierd_file_range* ranges,
                          uint64_t* bytes, int* direct) {
  if (client == nullptr || (ranges == nullptr && n > 0)) {
    return Invalid("tierd_import: NULL argument");
  }
  return Guard([&] {
    static_assert(sizeof(tierd_file_range) == sizeof(tierd::Client::FileRange));
    std::vector<tierd::Client::FileRange> r(n);
    for (size_t i = 0; i < n; ++i) {
      r[i] = {ranges[i].file_offset, ranges[i].chunk_offset, ranges[i].length};
    }
    absl::StatusOr<tierd::Client::Imported> done =
        client->client->Import(id, fd, file_size, file_mtime_ns, r);
    if (!done.ok()) return Fail(done.status());
    if (bytes != nullptr) *bytes = done->bytes;
    if (direct != nullptr) *direct = done->direct ? 1 : 0;
    return TIERD_OK;
  });
}

tierd_status tierd_tier_usage_get(tierd_client* client, int tier, tierd_tier_usage* out) {
  if (client == nullptr || out == nullptr) return Invalid("tierd_tier_usage_get: NULL argument");
  return Guard([&] {
    absl::StatusOr<tierd::NodeInfo> info = client->client->GetNodeInfo();
    if (!info.ok()) return Fail(info.status());
    const tierd::TierStatus* t = info->tier(static_cast<tierd::Tier>(tier));
    if (t == nullptr) return Invalid("tierd_tier_usage_get: unknown tier");
    *out = tierd_tier_usage{t->configured ? 1 : 0, t->capacity_bytes, t->used_bytes, t->free_bytes,
                            t->largest_free_bytes};
    return TIERD_OK;
  });
}

tierd_status tierd_chunk_count(tierd_client* client, uint64_t* out) {
  if (client == nullptr || out == nullptr) return Invalid("tierd_chunk_count: NULL argument");
  return Guard([&] {
    absl::StatusOr<std::vector<tierd::ChunkInfo>> chunks = client->client->ListChunks();
    if (!chunks.ok()) return Fail(chunks.status());
    *out = chunks->size();
    return TIERD_OK;
  });
}

tierd_status tierd_path_bytes(tierd_client* client, const char* path, uint64_t* bytes) {
  if (client == nullptr || path == nullptr || bytes == nullptr) {
    return Invalid("tierd_path_bytes: NULL argument");
  }
  return Guard([&] {
    absl::StatusOr<tierd::NodeInfo> info = client->client->GetNodeInfo();
    if (!info.ok()) return Fail(info.status());
    const tierd::PathStatus* p = info->path(path);
    if (p == nullptr) {
      return Fail(absl::NotFoundError(absl::StrCat("the daemon has no path '", path, "'")));
    }
    *bytes = p->bytes;
    return TIERD_OK;
  });
}

}  // extern "C"
