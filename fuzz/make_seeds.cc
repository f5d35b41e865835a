// Writes the rpc fuzzer's seed inputs: short sessions of well-formed requests, in the fuzzer's
// framing ([method][length][message]), with chunk ids 0..3 naming the session's own chunks.
// Usage: fuzz_seeds DIR
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tierd/v1/tierd.pb.h"

namespace pb = ::tierd::v1;

namespace {

// The fuzzer's method numbers.
enum Method {
  kAllocate = 0,
  kFree,
  kPrefetch,
  kEvict,
  kAcquire,
  kRelease,
  kStat,
  kListChunks,
  kGetNodeInfo,
  kSetSchedule,
  kGetSessionStats,
  kSetBandwidthWeight,
  kDrain,
  kDiscard
};

struct Seed {
  std::string bytes;
  void Add(Method m, const google::protobuf::Message& message) {
    const std::string body = message.SerializeAsString();
    if (body.size() > 255) std::abort();
    bytes += static_cast<char>(m);
    bytes += static_cast<char>(body.size());
    bytes += body;
  }
  void Write(const std::string& path) const { std::ofstream(path, std::ios::binary) << bytes; }
};

template <typename R>
R Ids(std::initializer_list<uint64_t> ids) {
  R r;
  for (uint64_t id : ids) r.add_chunk_ids(id);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  const std::string dir = argv[1];
  pb::AllocateRequest alloc;
  for (int i = 0; i < 4; ++i) alloc.add_chunks()->set_size_bytes(1 << 20);
  pb::AllocateRequest persistent;
  pb::ChunkSpec* spec = persistent.add_chunks();
  spec->set_size_bytes(64 << 10);
  spec->set_name("job/opt/m");
  spec->set_persistent(true);
  spec->set_open_existing(true);

  {  // A chunk's whole round: written on the host, down to NVMe, up to the device, back.
    Seed s;
    s.Add(kAllocate, alloc);
    auto acquire = Ids<pb::AcquireRequest>({0, 1});
    acquire.set_tier(pb::TIER_HOST);
    acquire.set_mode(pb::ACCESS_MODE_WRITE);
    s.Add(kAcquire, acquire);
    s.Add(kRelease, Ids<pb::ReleaseRequest>({0, 1}));
    s.Add(kDiscard, Ids<pb::DiscardRequest>({1}));  // goes down unwritten
    auto evict = Ids<pb::EvictRequest>({0, 1, 2, 3});
    evict.set_tier(pb::TIER_NVME);
    s.Add(kEvict, evict);
    auto prefetch = Ids<pb::PrefetchRequest>({0, 1, 2, 3});
    prefetch.set_tier(pb::TIER_DEVICE);
    s.Add(kPrefetch, prefetch);
    s.Add(kStat, Ids<pb::StatRequest>({0, 1, 2, 3}));
    s.Write(dir + "/round_trip");
  }
  {  // A schedule, and the session ends while moves are under way.
    Seed s;
    s.Add(kAllocate, alloc);
    pb::SetScheduleRequest schedule;
    for (uint64_t id : {0, 1, 2}) {
      pb::StepAccess* a = schedule.add_steps()->add_accesses();
      a->set_chunk_id(id);
      a->set_tier(pb::TIER_HOST);
      a->set_mode(pb::ACCESS_MODE_WRITE);
    }
    s.Add(kSetSchedule, schedule);
    auto evict = Ids<pb::EvictRequest>({0, 1, 2, 3});
    evict.set_tier(pb::TIER_NVME);
    s.Add(kEvict, evict);
    auto prefetch = Ids<pb::PrefetchRequest>({0, 1, 2, 3});
    prefetch.set_tier(pb::TIER_HOST);
    s.Add(kPrefetch, prefetch);
    s.Add(kGetSessionStats, pb::GetSessionStatsRequest());
    s.Write(dir + "/schedule_and_killed_mid_move");
  }
  {  // Persistent state, opened, flushed, listed; an operator's view and drain.
    Seed s;
    s.Add(kAllocate, persistent);
    auto flush = Ids<pb::PrefetchRequest>({0});
    flush.set_tier(pb::TIER_NVME);
    s.Add(kPrefetch, flush);
    s.Add(kAllocate, persistent);
    pb::ListChunksRequest list;
    list.set_all_sessions(true);
    s.Add(kListChunks, list);
    pb::GetNodeInfoRequest info;
    info.set_list_sessions(true);
    s.Add(kGetNodeInfo, info);
    pb::DrainRequest drain;
    drain.set_tier(pb::TIER_HOST);
    s.Add(kDrain, drain);
    pb::SetBandwidthWeightRequest weight;
    weight.set_weight(4);
    s.Add(kSetBandwidthWeight, weight);
    s.Add(kFree, Ids<pb::FreeRequest>({0}));
    s.Write(dir + "/persistent_and_operator");
  }
  return 0;
}
