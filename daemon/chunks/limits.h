// What one user (uid) or one session may hold of the daemon, so that no tenant can starve the
// others of sessions, connections, chunk-table entries, planning time or tier space. Configured in
// [limits] and [quota] (docs/configuration.md); a request that would pass a limit fails with
// RESOURCE_EXHAUSTED naming it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

struct Limits {
  // Connections on the session socket, with or without a session yet.
  uint32_t connections_per_uid = 256;
  uint32_t sessions_per_uid = 128;
  // Chunks in the table: a session's scratch chunks and opened persistent ones; all of a user's
  // (scratch and persistent, whether any session holds them).
  uint64_t chunks_per_session = 1'000'000;
  uint64_t chunks_per_uid = 1'000'000;
  // Accesses in a session's schedule (declared or traced), and over all of a user's sessions; a
  // schedule has at most as many steps as accesses.
  uint64_t schedule_accesses_per_session = 262'144;
  uint64_t schedule_accesses_per_uid = 1'048'576;
  // The longest iteration a trace may record.
  uint32_t trace_steps = 65'536;
};

// Bytes per tier (indexed by TierKind; 0: no quota) a user's chunks may hold: the space reserved
// for every copy, scratch and persistent alike.
using TierBytes = TierArray<uint64_t>;

struct Quotas {
  TierBytes per_uid{};                              // every user's, unless overridden
  absl::flat_hash_map<uint32_t, TierBytes> by_uid;  // a user's own (0 in a tier: no quota)
  // Users named in the config, resolved to uids at start-up (for messages and tierctl).
  absl::flat_hash_map<uint32_t, std::string> names;

  const TierBytes& For(uint32_t uid) const {
    auto it = by_uid.find(uid);
    return it == by_uid.end() ? per_uid : it->second;
  }
};

}  // namespace tierd::daemon
