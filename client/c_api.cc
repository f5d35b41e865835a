// The C ABI over tierd::Client. No exception crosses it: every entry point catches.
#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tierd/client.h"
#include "tierd/client.hpp"

struct tierd_client {
  std::unique_ptr<tierd::Client> client;
};

namespace {

thread_local std::string last_error;

tierd_status Fail(const absl::Status& s) {
  last_error = s.ToString();
  return static_cast<tierd_status>(static_cast<int>(s.code()));
}

tierd_status Done(const absl::Status& s) {
  if (s.ok()) return TIERD_OK;
  return Fail(s);
}

tierd_status Invalid(const char* what) { return Fail(absl::InvalidArgumentError(what)); }

// Runs `body`, turning exceptions (e.g. std::bad_alloc) into TIERD_INTERNAL.
template <typename Body>
tierd_status Guard(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(std::string("tierd client: ") + e.what()));
  } catch (...) {
    return Fail(absl::InternalError("tierd client: unknown exception"));
  }
}

std::span<const tierd::ChunkId> Ids(size_t n, const tierd_chunk_id* ids) { return {ids, n}; }

tierd::CompletionToken Token(tierd_completion c) { return {c.slot, c.sequence}; }
tierd_completion Token(tierd::CompletionToken t) { return {t.slot, t.sequence}; }

}  // namespace

extern "C" {

int tierd_abi_version(void) { return TIERD_C_ABI_VERSION; }

const char* tierd_last_error(void) { return last_error.c_str(); }

tierd_status tierd_connect(const char* socket_dir, const char* client_name, tierd_client** out) {
  if (out == nullptr) return Invalid("tierd_connect: out is NULL");
  *out = nullptr;
  return Guard([&] {
    tierd::ClientOptions options;
    if (socket_dir != nullptr) options.socket_dir = socket_dir;
    if (client_name != nullptr) options.client_name = client_name;
    absl::StatusOr<std::unique_ptr<tierd::Client>> client = tierd::Client::Connect(options);
    if (!client.ok()) return Fail(client.status());
    *out = new tierd_client{std::move(*client)};
    return TIERD_OK;
  });
}

void tierd_close(tierd_client* client) {
  try {
    delete client;
  } catch (...) {
  }
}

uint64_t tierd_session_id(const tierd_client* client) {
  return client == nullptr ? 0 : client->client->session_id();
}

tierd_status tierd_allocate(tierd_client* client, size_t n, const uint64_t* sizes, int home_tier,
                            tierd_chunk_id* out_ids) {
  if (client == nullptr || (n > 0 && (sizes == nullptr || out_ids == nullptr))) {
    return Invalid("tierd_allocate: NULL client, sizes or out_ids");
  }
  return Guard([&] {
    std::vector<tierd::ChunkSpec> specs(n);
    for (size_t i = 0; i < n; ++i) {
      specs[i].size = sizes[i];
      specs[i].home = static_cast<tierd::Tier>(home_tier);
    }
    absl::StatusOr<std::vector<tierd::ChunkId>> ids = client->client->AllocateIds(specs);
    if (!ids.ok()) return Fail(ids.status());
    std::copy(ids->begin(), ids->end(), out_ids);
    return TIERD_OK;
  });
}

tierd_status tierd_allocate_named(tierd_client* client, const char* name, uint64_t size,
                                  int home_tier, int persistent, int open_existing,
                                  tierd_chunk_id* out_id) {
  if (client == nullptr || name == nullptr || out_id == nullptr) {
    return Invalid("tierd_allocate_named: NULL client, name or out_id");
  }
  return Guard([&] {
    tierd::ChunkSpec spec;
    spec.size = size;
    spec.home = static_cast<tierd::Tier>(home_tier);
    spec.name = name;
    spec.persistent = persistent != 0;
    spec.open_existing = open_existing != 0;
    absl::StatusOr<std::vector<tierd::ChunkId>> ids = client->client->AllocateIds({&spec, 1});
    if (!ids.ok()) return Fail(ids.status());
    *out_id = (*ids)[0];
    return TIERD_OK;
  });
}

tierd_status tierd_free(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) return Invalid("tierd_free: NULL argument");
  return Guard([&] { return Done(client->client->Free(Ids(n, ids))); });
}

tierd_status tierd_acquire(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                           int access, void** out_ptrs, uint64_t* out_sizes,
                           tierd_completion* out_ready) {
  if (client == nullptr || (n > 0 && (ids == nullptr || out_ptrs == nullptr)) ||
      out_ready == nullptr) {
    return Invalid("tierd_acquire: NULL client, ids, out_ptrs or out_ready");
  }
  return Guard([&] {
    absl::StatusOr<tierd::Acquired> acquired = client->client->AcquireIds(
        Ids(n, ids), static_cast<tierd::Tier>(tier), static_cast<tierd::AccessMode>(access));
    if (!acquired.ok()) return Fail(acquired.status());
    for (size_t i = 0; i < n; ++i) {
      out_ptrs[i] = acquired->chunks[i].data;
      if (out_sizes != nullptr) out_sizes[i] = acquired->chunks[i].size;
    }
    *out_ready = Token(acquired->ready);
    return TIERD_OK;
  });
}

tierd_status tierd_release(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) {
    return Invalid("tierd_release: NULL argument");
  }
  return Guard([&] { return Done(client->client->Release(Ids(n, ids))); });
}

tierd_status tierd_prefetch(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                            int priority, tierd_completion* out) {
  if (client == nullptr || (n > 0 && ids == nullptr) || out == nullptr) {
    return Invalid("tierd_prefetch: NULL argument");
  }
  return Guard([&] {
    absl::StatusOr<tierd::CompletionToken> token =
        client->client->PrefetchIds(Ids(n, ids), static_cast<tierd::Tier>(tier), priority);
    if (!token.ok()) return Fail(token.status());
    *out = Token(*token);
    return TIERD_OK;
  });
}

tierd_status tierd_evict(tierd_client* client, size_t n, const tierd_chunk_id* ids, int tier,
                         int keep_source, tierd_completion* out) {
  if (client == nullptr || (n > 0 && ids == nullptr) || out == nullptr) {
    return Invalid("tierd_evict: NULL argument");
  }
  return Guard([&] {
    absl::StatusOr<tierd::CompletionToken> token =
        client->client->EvictIds(Ids(n, ids), static_cast<tierd::Tier>(tier), keep_source != 0);
    if (!token.ok()) return Fail(token.status());
    *out = Token(*token);
    return TIERD_OK;
  });
}

tierd_status tierd_poll(tierd_client* client, tierd_completion completion) {
  if (client == nullptr) return Invalid("tierd_poll: NULL client");
  absl::Status s = client->client->Poll(Token(completion));
  if (absl::IsUnavailable(s)) return TIERD_PENDING;
  return Done(s);
}

tierd_status tierd_wait(tierd_client* client, tierd_completion completion, int64_t timeout_ns) {
  if (client == nullptr) return Invalid("tierd_wait: NULL client");
  absl::Duration timeout =
      timeout_ns < 0 ? absl::InfiniteDuration() : absl::Nanoseconds(timeout_ns);
  return Done(client->client->Wait(Token(completion), timeout));
}

tierd_status tierd_device_info(tierd_client* client, char* uuid, size_t uuid_len, int* emulated,
                               uint64_t* memory_bytes) {
  if (client == nullptr || uuid == nullptr || uuid_len == 0) {
    return Invalid("tierd_device_info: NULL client or uuid buffer");
  }
  return Guard([&] {
    absl::StatusOr<tierd::NodeInfo> info = client->client->GetNodeInfo();
    if (!info.ok()) return Fail(info.status());
    if (info->device_uuid.empty()) {
      return Fail(
          absl::NotFoundError(absl::StrCat("this node has no device tier: ", info->device_status)));
    }
    const size_t n = std::min(uuid_len - 1, info->device_uuid.size());
    std::memcpy(uuid, info->device_uuid.data(), n);
    uuid[n] = '\0';
    if (emulated != nullptr) *emulated = info->device_emulated ? 1 : 0;
    if (memory_bytes != nullptr) *memory_bytes = info->device_memory_bytes;
    return TIERD_OK;
  });
}

tierd_status tierd_cuda_device(tierd_client* client, int* ordinal) {
  if (client == nullptr || ordinal == nullptr) return Invalid("tierd_cuda_device: NULL argument");
  return Guard([&] {
    absl::StatusOr<int> device = client->client->CudaDevice();
    if (!device.ok()) return Fail(device.status());
    *ordinal = *device;
    return TIERD_OK;
  });
}

tierd_status tierd_stream_wait(tierd_client* client, tierd_completion completion, uint64_t stream) {
  if (client == nullptr) return Invalid("tierd_stream_wait: NULL client");
  return Guard([&] {
    return Done(client->client->StreamWait(Token(completion), static_cast<uintptr_t>(stream)));
  });
}

tierd_status tierd_set_schedule(tierd_client* client, size_t n_steps, const size_t* step_lengths,
                                const tierd_chunk_id* ids, const int* tiers, const int* modes,
                                uint64_t host_quota_bytes, uint64_t device_quota_bytes) {
  if (client == nullptr || (n_steps > 0 && step_lengths == nullptr)) {
    return Invalid("tierd_set_schedule: NULL client or step_lengths");
  }
  size_t total = 0;
  for (size_t i = 0; i < n_steps; ++i) total += step_lengths[i];
  if (total > 0 && (ids == nullptr || tiers == nullptr || modes == nullptr)) {
    return Invalid("tierd_set_schedule: NULL ids, tiers or modes");
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
        steps[i].push_back({ids[next], static_cast<tierd::Tier>(tiers[next]),
                            static_cast<tierd::AccessMode>(modes[next])});
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

}  // extern "C"
