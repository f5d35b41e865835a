// The C ABI over tierd::Client: sessions, chunks and their DLPack views. (The node, schedules and
// shared bases are c_api_node.cc; the CPU Adam kernel's ABI is c_api_kernels.cc, the optimizer's
// c_api_optimizer.cc.)
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/c_api_common.h"
#include "client/c_api_session.h"
#include "dlpack/dlpack.h"
#include "tierd/client.h"
#include "tierd/client.hpp"

using tierd::c_abi::Done;
using tierd::c_abi::Fail;
using tierd::c_abi::Guard;
using tierd::c_abi::Ids;
using tierd::c_abi::Invalid;
using tierd::c_abi::Token;
using tierd::c_abi::ViewTable;

namespace tierd::c_abi {

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

}  // namespace tierd::c_abi

namespace {

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
    *out = new tierd_client{std::move(*client), std::make_shared<tierd::c_abi::ViewTable>()};
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

tierd_status tierd_discard(tierd_client* client, size_t n, const tierd_chunk_id* ids) {
  if (client == nullptr || (n > 0 && ids == nullptr)) {
    return Invalid("tierd_discard: NULL argument");
  }
  return Guard([&] {
    if (absl::Status s = client->client->Discard(Ids(n, ids)); !s.ok()) return Fail(s);
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

}  // extern "C"
