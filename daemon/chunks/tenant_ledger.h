// What each user (uid) holds of the daemon — bytes reserved in each tier, chunks, schedule
// accesses — against the limits and quotas of daemon/chunks/limits.h, and what was refused for
// passing them. The chunk service asks before it grants and records what it granted; the answer to
// a request that would pass a limit is RESOURCE_EXHAUSTED naming the limit, its value and what the
// user holds.
//
// Not thread-safe: the chunk service calls it under its own lock.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "daemon/chunks/limits.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

// The limits a request can run into, for the refusal counters (tierd_limit_refusals_total).
enum class LimitKind : uint8_t {
  kHostQuota = 0,
  kNvmeQuota,
  kDeviceQuota,
  kChunksPerSession,
  kChunksPerUid,
  kScheduleAccessesPerSession,
  kScheduleAccessesPerUid,
  kTraceSteps,
};
inline constexpr int kLimitKinds = 8;
// The config key of a limit: "quota.host", "limits.chunks_per_uid", ...
const char* LimitName(LimitKind kind);

struct TenantUsage {
  TierBytes bytes{};  // reserved, by TierKind
  uint64_t chunks = 0;
  uint64_t schedule_accesses = 0;
  std::array<uint64_t, kLimitKinds> refusals{};
};

class TenantLedger {
 public:
  void Configure(const Limits& limits, const Quotas& quotas) {
    limits_ = limits;
    quotas_ = quotas;
  }
  const Limits& limits() const { return limits_; }
  const Quotas& quotas() const { return quotas_; }

  // Bytes the user may still take in `tier` under its quota (UINT64_MAX without one).
  uint64_t Headroom(uint32_t uid, TierKind tier) const;
  // OK when `bytes` more in `tier` stay within the user's quota; else RESOURCE_EXHAUSTED (counted).
  absl::Status CheckBytes(uint32_t uid, TierKind tier, uint64_t bytes);
  void AddBytes(uint32_t uid, TierKind tier, uint64_t bytes);
  void RemoveBytes(uint32_t uid, TierKind tier, uint64_t bytes);

  // OK when `more` chunks stay within the user's limit and, with `session_chunks` held by the
  // session, within the session's.
  absl::Status CheckChunks(uint32_t uid, uint64_t session_chunks, uint64_t more);
  void AddChunks(uint32_t uid, int64_t delta);

  // OK when a session's schedule of `accesses` (replacing one of `replaced`) stays within both
  // the session's and the user's limits; `what` names the request in the message.
  absl::Status CheckSchedule(uint32_t uid, uint64_t replaced, uint64_t accesses, const char* what);
  absl::Status CheckTrace(uint32_t uid, uint64_t steps);
  void AddScheduleAccesses(uint32_t uid, int64_t delta);

  // Every user holding anything, or refused anything, by uid.
  std::map<uint32_t, TenantUsage> Usage() const;
  TenantUsage UsageOf(uint32_t uid) const;

 private:
  absl::Status Refuse(uint32_t uid, LimitKind kind, std::string message);
  void ForgetIfEmpty(uint32_t uid);

  Limits limits_;
  Quotas quotas_;
  absl::flat_hash_map<uint32_t, TenantUsage> usage_;
};

}  // namespace tierd::daemon
