// Every RPC's request handling, as a hostile client drives it: an in-process daemon (host pool,
// NVMe region on io_uring, emulated device, the real gRPC service on a Unix socket) receives the
// requests the input spells, in one session. A request that parses has its chunk ids 0..63 turned
// into the chunks this input allocated, so that sequences of operations on real chunks are found;
// one that does not is sent as the raw bytes. After each input the session ends as a killed
// client's would; once the moves in flight settle each tier's bytes in use must be the space its
// chunks take there, and every byte must come back when they are freed.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/api/rpc_server.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/device/device.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "fuzz/scratch_dir.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd::daemon {
namespace {

namespace pb = ::tierd::v1;

struct Daemon {
  std::unique_ptr<SegmentPool> host, device_pool;
  std::unique_ptr<NvmeTier> nvme;
  std::unique_ptr<Device> device;
  std::unique_ptr<ChunkService> chunks;
  std::unique_ptr<SessionRegistry> sessions;
  std::unique_ptr<RpcServer> server;
  std::unique_ptr<grpc::GenericStub> stub;
};

Daemon& TheDaemon() {
  static Daemon* d = [] {
    spdlog::set_level(spdlog::level::off);
    auto* d = new Daemon;
    const std::string dir = FuzzScratchDir("/var/tmp", "rpc");
    d->host = std::move(*CreateHostPool({.capacity = 32 << 20,
                                         .segment_size = 16 << 20,
                                         .huge_pages = HugePagePolicy::kNever,
                                         .lock_memory = false}));
    NvmeOptions o;
    o.regions = {{absl::StrCat(dir, "/r0"), 64 << 20}};
    o.queue_depth = 8;
    InstanceId id{};
    auto nvme = NvmeTier::Open(o, id, d->host.get());
    if (!nvme.ok()) abort();
    d->nvme = std::move(*nvme);
    d->device = MakeEmulatedDevice({.memory_bytes = 32 << 20, .gbps = 100});
    d->device_pool = std::move(*SegmentPool::Create(TierKind::kDevice, "device", 32 << 20, 16 << 20,
                                                    d->device->MakeBacking()));
    d->chunks = std::make_unique<ChunkService>(
        NodeTiers(d->host.get(), d->nvme.get(), d->device_pool.get(), d->device.get()));
    Limits limits;
    limits.chunks_per_session = 128;
    limits.chunks_per_uid = 256;
    limits.schedule_accesses_per_session = 256;
    limits.trace_steps = 64;
    d->chunks->set_limits(limits, Quotas{});
    d->sessions = std::make_unique<SessionRegistry>();
    const std::string path = absl::StrCat(dir, "/tierd.sock");
    auto server = RpcServer::Start(path, {d->sessions.get(), d->chunks.get(), {}, d->nvme.get()});
    if (!server.ok()) abort();
    d->server = std::move(*server);
    d->stub = std::make_unique<grpc::GenericStub>(
        grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials()));
    return d;
  }();
  return *d;
}

// The methods, by the input's selector byte.
constexpr const char* kMethods[] = {
    "Allocate", "Free",       "Prefetch",    "Evict",       "Acquire",         "Release",
    "Stat",     "ListChunks", "GetNodeInfo", "SetSchedule", "GetSessionStats", "SetBandwidthWeight",
    "Drain",    "Discard"};
constexpr int kMethodCount = sizeof(kMethods) / sizeof(kMethods[0]);

// Ids below 64 name the input's own chunks, in the order they were allocated.
uint64_t Remap(uint64_t id, const std::vector<uint64_t>& mine) {
  return id < 64 && !mine.empty() ? mine[id % mine.size()] : id;
}

template <typename Request>
bool RemapIds(const std::string& bytes, const std::vector<uint64_t>& mine, std::string* out) {
  Request r;
  if (!r.ParseFromString(bytes)) return false;
  if constexpr (requires { r.mutable_chunk_ids(); }) {
    for (auto& id : *r.mutable_chunk_ids()) id = Remap(id, mine);
  }
  if constexpr (std::is_same_v<Request, pb::SetScheduleRequest>) {
    for (auto& step : *r.mutable_steps()) {
      for (auto& a : *step.mutable_accesses()) a.set_chunk_id(Remap(a.chunk_id(), mine));
    }
  }
  return r.SerializeToString(out);
}

std::string Prepare(int method, const std::string& bytes, const std::vector<uint64_t>& mine) {
  std::string out;
  bool ok = false;
  switch (method) {
    case 1:
      ok = RemapIds<pb::FreeRequest>(bytes, mine, &out);
      break;
    case 2:
      ok = RemapIds<pb::PrefetchRequest>(bytes, mine, &out);
      break;
    case 3:
      ok = RemapIds<pb::EvictRequest>(bytes, mine, &out);
      break;
    case 4:
      ok = RemapIds<pb::AcquireRequest>(bytes, mine, &out);
      break;
    case 5:
      ok = RemapIds<pb::ReleaseRequest>(bytes, mine, &out);
      break;
    case 6:
      ok = RemapIds<pb::StatRequest>(bytes, mine, &out);
      break;
    case 9:
      ok = RemapIds<pb::SetScheduleRequest>(bytes, mine, &out);
      break;
    case 12:
      ok = RemapIds<pb::DrainRequest>(bytes, mine, &out);
      break;
    case 13:
      ok = RemapIds<pb::DiscardRequest>(bytes, mine, &out);
      break;
    default:
      break;
  }
  return ok ? out : bytes;
}

grpc::Status Call(Daemon& d, const std::string& credential, int method, const std::string& body,
                  std::string* response) {
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1), reply;
  grpc::ClientContext ctx;
  ctx.AddMetadata("tierd-session", credential);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  std::promise<grpc::Status> done;
  d.stub->UnaryCall(&ctx, absl::StrCat("/tierd.v1.Tierd/", kMethods[method]), grpc::StubOptions(),
                    &request, &reply, [&](grpc::Status s) { done.set_value(s); });
  grpc::Status status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  if (status.ok() && reply.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      response->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return status;
}

// Waits for every move to settle; a move that never does is a hang.
void Settle(Daemon& d) {
  for (absl::Time give_up = absl::Now() + absl::Seconds(10);;) {
    d.device->Drain();
    d.nvme->Drain();
    if (d.chunks->node_stats().chunks_moving == 0) return;
    if (absl::Now() > give_up) __builtin_trap();
    absl::SleepFor(absl::Milliseconds(1));
  }
}

}  // namespace
}  // namespace tierd::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tierd;
  using namespace tierd::daemon;
  Daemon& d = TheDaemon();
  auto session = d.sessions->Open(
      {static_cast<uint32_t>(getuid()), static_cast<uint32_t>(getgid()), getpid()}, "fuzz");
  if (!session.ok()) abort();
  const std::string credential = absl::StrCat((*session)->id, ":", (*session)->TokenHex());
  std::vector<uint64_t> mine;
  // Requests: [method][length][bytes...].
  size_t pos = 0;
  for (int calls = 0; pos + 2 <= size && calls < 32; ++calls) {
    const int method = data[pos] % kMethodCount;
    const size_t length = std::min<size_t>(data[pos + 1], size - pos - 2);
    const std::string bytes(reinterpret_cast<const char*>(data + pos + 2), length);
    pos += 2 + length;
    std::string response;
    grpc::Status s = Call(d, credential, method, Prepare(method, bytes, mine), &response);
    if (s.error_code() == grpc::StatusCode::INTERNAL ||
        s.error_code() == grpc::StatusCode::UNKNOWN) {
      __builtin_trap();  // every refusal has a code that says whose fault it is
    }
    if (s.ok() && method == 0) {
      pb::AllocateResponse allocated;
      if (allocated.ParseFromString(response)) {
        for (uint64_t id : allocated.chunk_ids()) mine.push_back(id);
      }
    }
  }
  // The client dies.
  d.sessions->Close((*session)->id);
  d.chunks->CloseSession(**session);
  Settle(d);
  // A persistent chunk outlives its session: a cleaner frees them, and then nothing may be left.
  auto cleaner = d.sessions->Open(
      {static_cast<uint32_t>(getuid()), static_cast<uint32_t>(getgid()), getpid()}, "cleaner");
  if (!cleaner.ok()) abort();
  ChunkPage page = d.chunks->List(**cleaner, 0, 100000);
  // Nothing moves: each tier's bytes in use are the space its chunks' copies take there.
  TierArray<uint64_t> space;
  for (const ChunkMeta& c : page.chunks) {
    for (TierKind t : kAllTiers) {
      if (c.allocated.contains(t)) space[t] += c.placement[t].size;
    }
  }
  for (TierKind t : kAllTiers) {
    if (d.chunks->tier(t)->Usage().used_bytes != space[t]) __builtin_trap();
  }
  for (const ChunkMeta& c : page.chunks) {
    const ChunkId id = c.id;
    if (!d.chunks->Free(**cleaner, {&id, 1}).ok()) __builtin_trap();
  }
  d.sessions->Close((*cleaner)->id);
  d.chunks->CloseSession(**cleaner);
  Settle(d);
  if (d.chunks->chunk_count() != 0) __builtin_trap();
  for (TierKind t : kAllTiers) {
    if (d.chunks->tier(t)->Usage().used_bytes != 0) __builtin_trap();
  }
  return 0;
}
