// The C ABI over tierd::Client: sessions, chunks, their DLPack views and schedules. (The CPU Adam
// kernel's ABI is c_api_kernels.cc, the optimizer's c_api_optimizer.cc.)
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/c_api_common.h"
#include "common/completion_page.h"
#include "dlpack/dlpack.h"
#include "tierd/client.h"
#include "tierd/client.hpp"

using tierd::c_abi::Done;
using tierd::c_abi::Fail;
using tierd::c_abi::Guard;
using tierd::c_abi::Invalid;

namespace {

// The chunks this handle holds acquired and the DLPack views of them that are alive. Shared with
// the views, whose deleters may run on any thread, after tierd_close included.
struct ViewTable {
  struct Held {
    uint32_t pins = 0;   // acquisitions through this handle not yet released
    uint32_t views = 0;  // DLPack tensors viewing the chunk
    // Handed to the last view (tierd_release_deferred, tierd_free_deferred): releases of pins
    // and the chunk's free, done when the last view is dropped.
    uint32_t deferred_releases = 0;
    bool deferred_free = false;
    // Where the latest acquisition in each tier put it.
    struct Place {
      char* data = nullptr;
      uint64_t size = 0;
      bool host_accessible = true;
    };
    std::array<Place, 3> place;  // host, NVMe, device
    // The place in tier `tier` (a TIERD_TIER_*); null for a value that names no tier.
    Place* In(int tier) {
      if (tier < TIERD_TIER_HOST || tier > TIERD_TIER_DEVICE) return nullptr;
      return &place[tier - TIERD_TIER_HOST];
    }
  };
  absl::Mutex mu;
  absl::flat_hash_map<tierd::ChunkId, Held> held ABSL_GUARDED_BY(mu);

  // FAILED_PRECONDITION naming the first of ids that a live view holds. A release drops one
  // acquisition (`last_pin_only`: refused only for the last); a free drops them all.
  absl::Status RefuseViewed(const char* what, size_t n, const tierd_chunk_id* ids,
                            bool last_pin_only) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (size_t i = 0; i < n; ++i) {
      auto it = held.find(ids[i]);
      if (it != held.end() && it->second.views > 0 && (!last_pin_only || it->second.pins <= 1)) {
        return absl::FailedPreconditionError(
            absl::StrCat(what, ": chunk ", ids[i], " has ", it->second.views,
                         " live DLPack view(s); drop the tensors viewing it first"));
      }
    }
    return absl::OkStatus();
  }

  // Releases of `ids` through this handle went through: one pin fewer on each.
  void Released(std::span<const tierd::ChunkId> ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (tierd::ChunkId id : ids) {
      auto it = held.find(id);
      if (it == held.end()) continue;
      if (it->second.pins > 0) --it->second.pins;
      if (it->second.pins == 0 && it->second.views == 0) held.erase(it);
    }
  }
};

}  // namespace

// The session is shared with the DLPack views of its chunks: a view keeps it (and the mappings
// its pointer is in) open after tierd_close until the view's deleter runs.
struct tierd_client {
  std::shared_ptr<tierd::Client> client;
  std::shared_ptr<ViewTable> views = std::make_shared<ViewTable>();
};

namespace {

std::span<const tierd::ChunkId> Ids(size_t n, const tierd_chunk_id* ids) { return {ids, n}; }

tierd::CompletionToken Token(tierd_completion c) { return {c.slot, c.sequence}; }
tierd_completion Token(tierd::CompletionToken t) { return {t.slot, t.sequence}; }

// Of `ids`, those to release or free now: a chunk that a DLPack view still holds is handed to its
// last view instead when `defer(its entry)` says so (and marks it).
template <typename Defer>
std::vector<tierd::ChunkId> HandToViews(tierd_client* client, size_t n, const tierd_chunk_id* ids,
                                        Defer defer)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(client->views->mu) {
  auto& held = client->views->held;
  std::vector<tierd::ChunkId> now;
  for (size_t i = 0; i < n; ++i) {
    auto it = held.find(ids[i]);
    if (it != held.end() && it->second.views > 0 && defer(it->second)) continue;
    now.push_back(ids[i]);
  }
  return now;
}

// tierd_allocate and tierd_allocate_transient.
tierd_status Allocate(tierd_client* client, size_t n, const uint64_t* sizes, int home_tier,
                      bool transient, tierd_chunk_id* out_ids) {
  if (client == nullptr || (n > 0 && (sizes == nullptr || out_ids == nullptr))) {
    return Invalid("tierd_allocate: NULL client, sizes or out_ids");
  }
  return Guard([&] {
    std::vector<tierd::ChunkSpec> specs(n);
    for (size_t i = 0; i < n; ++i) {
      specs[i].size = sizes[i];
      specs[i].home = static_cast<tierd::Tier>(home_tier);
      specs[i].transient = transient;
    }
    absl::StatusOr<std::vector<tierd::ChunkId>> ids = client->client->AllocateIds(specs);
    if (!ids.ok()) return Fail(ids.status());
    std::copy(ids->begin(), ids->end(), out_ids);
    return TIERD_OK;
  });
}

}  // namespace

extern "C" {

int tierd_abi_version(void) { return TIERD_C_ABI_VERSION; }

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
  return Allocate(client, n, sizes, home_tier, false, out_ids);
}

tierd_status tierd_allocate_transient(tierd_client* client, size_t n, const uint64_t* sizes,
                                      int home_tier, tierd_chunk_id* out_ids) {
  return Allocate(client, n, sizes, home_tier, true, out_ids);
}

tierd_status tierd_allocate_named(tierd_client* client, const char* name, uint64_t size,
                                  int home_tier, int persistent, int open, tierd_chunk_id* out_id) {
  if (client == nullptr || name == nullptr || out_id == nullptr) {
    return Invalid("tierd_allocate_named: NULL client, name or out_id");
  }
  return Guard([&] {
    tierd::ChunkSpec spec;
    spec.size = size;
    spec.home = static_cast<tierd::Tier>(home_tier);
    spec.name = name;
    spec.persistent = persistent != 0;
    if ((open & ~(TIERD_OPEN_EXISTING | TIERD_OPEN_MUST_EXIST | TIERD_OPEN_SHARED)) != 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("tierd_allocate_named: unknown open flags ", open)));
    }
    spec.open_existing = (open & TIERD_OPEN_EXISTING) != 0;
    spec.must_exist = (open & TIERD_OPEN_MUST_EXIST) != 0;
    spec.shared = (open & TIERD_OPEN_SHARED) != 0;
    absl::StatusOr<std::vector<tierd::ChunkId>> ids = client->client->AllocateIds({&spec, 1});
    if (!ids.ok()) return Fail(ids.status());
    *out_id = (*ids)[0];
    return TIERD_OK;
  });
}

tierd_status tierd_free(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) return Invalid("tierd_free: NULL argument");
  return Guard([&] {
    absl::MutexLock lock(&client->views->mu);
    auto& held = client->views->held;
    if (absl::Status s = client->views->RefuseViewed("tierd_free", n, ids, /*last_pin_only=*/false);
        !s.ok()) {
      return Fail(s);
    }
    if (absl::Status s = client->client->Free(Ids(n, ids)); !s.ok()) return Fail(s);
    for (size_t i = 0; i < n; ++i) held.erase(ids[i]);  // freeing drops the session's pins
    return TIERD_OK;
  });
}

tierd_status tierd_release_deferred(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) {
    return Invalid("tierd_release_deferred: NULL argument");
  }
  return Guard([&] {
    absl::MutexLock lock(&client->views->mu);
    const std::vector<tierd::ChunkId> now = HandToViews(client, n, ids, [](auto& held) {
      if (held.pins > held.deferred_releases + 1) return false;
      ++held.deferred_releases;  // the last pin under a view: the view releases it
      return true;
    });
    if (now.empty()) return TIERD_OK;
    if (absl::Status s = client->client->Release(now); !s.ok()) return Fail(s);
    client->views->Released(now);
    return TIERD_OK;
  });
}

tierd_status tierd_free_deferred(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) {
    return Invalid("tierd_free_deferred: NULL argument");
  }
  return Guard([&] {
    absl::MutexLock lock(&client->views->mu);
    const std::vector<tierd::ChunkId> now = HandToViews(client, n, ids, [](auto& held) {
      held.deferred_free = true;  // the last view frees it, its pins released first
      return true;
    });
    if (now.empty()) return TIERD_OK;
    if (absl::Status s = client->client->Free(now); !s.ok()) return Fail(s);
    for (tierd::ChunkId id : now) client->views->held.erase(id);  // freeing drops the pins
    return TIERD_OK;
  });
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
    absl::MutexLock lock(&client->views->mu);
    for (size_t i = 0; i < n; ++i) {
      const tierd::AcquiredChunk& chunk = acquired->chunks[i];
      out_ptrs[i] = chunk.data;
      if (out_sizes != nullptr) out_sizes[i] = chunk.size;
      ViewTable::Held& held = client->views->held[chunk.id];
      held.pins += 1;
      if (ViewTable::Held::Place* place = held.In(static_cast<int>(chunk.tier))) {
        *place = {static_cast<char*>(chunk.data), chunk.size, chunk.host_accessible};
      }
    }
    *out_ready = Token(acquired->ready);
    return TIERD_OK;
  });
}

tierd_status tierd_release(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) {
    return Invalid("tierd_release: NULL argument");
  }
  return Guard([&] {
    // Held across the call so that no view is taken of a chunk while it is being released.
    absl::MutexLock lock(&client->views->mu);
    if (absl::Status s =
            client->views->RefuseViewed("tierd_release", n, ids, /*last_pin_only=*/true);
        !s.ok()) {
      return Fail(s);
    }
    if (absl::Status s = client->client->Release(Ids(n, ids)); !s.ok()) return Fail(s);
    client->views->Released(Ids(n, ids));
    return TIERD_OK;
  });
}

namespace {

// What a DLPack view owns: the tensor handed out, its shape and strides, and references that keep
// the session and the view count alive until the consumer calls the deleter.
struct ViewContext {
  DLManagedTensor tensor{};
  int64_t shape[TIERD_DLPACK_MAX_DIMS] = {};
  int64_t strides[TIERD_DLPACK_MAX_DIMS] = {};
  std::shared_ptr<tierd::Client> client;
  std::shared_ptr<ViewTable> views;
  tierd::ChunkId id = 0;
};

void DeleteView(DLManagedTensor* self) {
  if (self == nullptr) return;
  auto* context = static_cast<ViewContext*>(self->manager_ctx);
  uint32_t releases = 0;
  bool free = false;
  {
    absl::MutexLock lock(&context->views->mu);
    auto it = context->views->held.find(context->id);
    if (it != context->views->held.end() && it->second.views > 0) {
      ViewTable::Held& held = it->second;
      --held.views;
      if (held.views == 0) {  // the last view: what was handed to it is done now
        releases = std::exchange(held.deferred_releases, 0);
        free = std::exchange(held.deferred_free, false);
        held.pins -= std::min(held.pins, releases);
      }
      if (free || (held.pins == 0 && held.views == 0)) context->views->held.erase(it);
    }
  }
  // Outside the lock (a call to the daemon), on whatever thread drops the tensor. Nobody is left
  // to hear of a failure; a session that ends reclaims the chunks anyway.
  const tierd::ChunkId id = context->id;
  for (uint32_t i = 0; i < releases; ++i) (void)context->client->Release({&id, 1});
  if (free) (void)context->client->Free({&id, 1});
  // The last reference to a closed handle's session ends it here.
  delete context;
}

bool ValidDLType(int code, int bits) {
  switch (code) {
    case kDLInt:
    case kDLUInt:
      return bits == 8 || bits == 16 || bits == 32 || bits == 64;
    case kDLFloat:
      return bits == 16 || bits == 32 || bits == 64;
    case kDLBfloat:
      return bits == 16;
    default:
      return false;
  }
}

}  // namespace

tierd_status tierd_chunk_dlpack(tierd_client* client, tierd_chunk_id id, int tier, uint64_t offset,
                                int dl_code, int dl_bits, int ndim, const int64_t* shape,
                                DLManagedTensor** out) {
  if (out != nullptr) *out = nullptr;
  if (client == nullptr || out == nullptr || (ndim > 0 && shape == nullptr)) {
    return Invalid("tierd_chunk_dlpack: NULL client, shape or out");
  }
  if (tier != TIERD_TIER_HOST && tier != TIERD_TIER_DEVICE) {
    return Invalid("tierd_chunk_dlpack: views are of the host or device tier");
  }
  if (ndim < 0 || ndim > TIERD_DLPACK_MAX_DIMS) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("tierd_chunk_dlpack: ndim ", ndim, " outside 0..", TIERD_DLPACK_MAX_DIMS)));
  }
  if (!ValidDLType(dl_code, dl_bits)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "tierd_chunk_dlpack: unsupported DLPack type (code ", dl_code, ", bits ", dl_bits, ")")));
  }
  return Guard([&]() -> tierd_status {
    const uint64_t item = static_cast<uint64_t>(dl_bits) / 8;
    uint64_t elements = 1;
    for (int d = 0; d < ndim; ++d) {
      if (shape[d] < 0) return Invalid("tierd_chunk_dlpack: negative dimension");
      const auto extent = static_cast<uint64_t>(shape[d]);
      if (extent != 0 && elements > UINT64_MAX / extent) {
        return Invalid("tierd_chunk_dlpack: shape overflows");
      }
      elements *= extent;
    }
    if (elements > UINT64_MAX / item) return Invalid("tierd_chunk_dlpack: shape overflows");
    const uint64_t bytes = elements * item;
    if (offset % item != 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("tierd_chunk_dlpack: offset ", offset, " is not a multiple of ", item)));
    }

    auto context = std::make_unique<ViewContext>();
    absl::MutexLock lock(&client->views->mu);
    auto it = client->views->held.find(id);
    const ViewTable::Held::Place* place =
        it == client->views->held.end() || it->second.pins == 0 ? nullptr : it->second.In(tier);
    if (place == nullptr || place->data == nullptr) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("tierd_chunk_dlpack: chunk ", id, " is not acquired in the ",
                       tierd::TierName(static_cast<tierd::Tier>(tier)), " tier by this session")));
    }
    if (offset > place->size || bytes > place->size - offset) {
      return Fail(
          absl::OutOfRangeError(absl::StrCat("tierd_chunk_dlpack: ", bytes, " bytes at offset ",
                                             offset, " run past chunk ", id, "'s ", place->size)));
    }
    DLDevice device{kDLCPU, 0};
    if (!place->host_accessible) {
      absl::StatusOr<int> ordinal = client->client->CudaDevice();
      if (!ordinal.ok()) return Fail(ordinal.status());
      device = {kDLCUDA, *ordinal};
    }
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      context->shape[d] = shape[d];
      context->strides[d] = stride;
      stride *= std::max<int64_t>(shape[d], 1);
    }
    DLTensor& t = context->tensor.dl_tensor;
    t.data = place->data + offset;
    t.device = device;
    t.ndim = ndim;
    t.dtype = {static_cast<uint8_t>(dl_code), static_cast<uint8_t>(dl_bits), 1};
    t.shape = context->shape;
    t.strides = context->strides;
    t.byte_offset = 0;
    context->client = client->client;
    context->views = client->views;
    context->id = id;
    context->tensor.manager_ctx = context.get();
    context->tensor.deleter = DeleteView;
    it->second.views += 1;
    *out = &context.release()->tensor;
    return TIERD_OK;
  });
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
