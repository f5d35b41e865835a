// Hostile traffic against a real daemon, as a fuzzer pointed at its socket makes it: sessions that
// each send a run of requests — structured (valid messages with random fields), mutated (those
// with bytes flipped, cut or repeated), random bytes, oversized (near and past the message limit)
// and forged (another session's or a dead session's credential) — and then die as a killed
// client does. Deterministic for a seed. Used by hostile_test.cc (the daemon's memory and its
// tiers' accounting under such traffic) and by tierd-hostile (long runs, for the benchmarks).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace tierd::testing {

struct HostileTrafficOptions {
  std::string socket_dir;
  uint64_t seed = 1;
  uint64_t requests = 1000;   // in all
  uint32_t per_session = 32;  // requests each session sends before it dies
};

struct HostileTrafficReport {
  uint64_t requests = 0;
  uint64_t sessions = 0;
  std::map<std::string, uint64_t> by_kind;  // structured, mutated, random, oversized, forged
  std::map<int, uint64_t> by_code;          // gRPC status codes of the answers
};

// Sends the traffic. An error only when the daemon cannot be reached or answers INTERNAL or
// UNKNOWN (a refusal must say whose fault it is).
absl::StatusOr<HostileTrafficReport> SendHostileTraffic(const HostileTrafficOptions& options);

// What the node holds, as an operator sees it: each tier's bytes in use, the space its chunks'
// copies take there (ChunkInfo.space), and the chunks. Once nothing moves the two are equal.
struct TierAccounting {
  uint64_t used_bytes[4] = {};    // by tier (pb::Tier): host 1, NVMe 2, device 3
  uint64_t copies_bytes[4] = {};  // the copies the chunks have there
  uint64_t chunks = 0;
};
absl::StatusOr<TierAccounting> AccountTiers(const std::string& socket_dir);
// The same once nothing moves: two readings alike, 50 ms apart (at most 10 s of trying).
absl::StatusOr<TierAccounting> SettledAccounting(const std::string& socket_dir);

// Frees every chunk left on the node (the persistent ones hostile sessions made, which outlive
// them), as an operator would, and waits until the tiers are empty or `patience` runs out.
absl::Status FreeEverything(const std::string& socket_dir);

}  // namespace tierd::testing
