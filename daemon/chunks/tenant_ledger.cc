#include "daemon/chunks/tenant_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/sizes.h"

namespace tierd::daemon {
namespace {

LimitKind QuotaKind(TierKind tier) {
  switch (tier) {
    case TierKind::kHost:
      return LimitKind::kHostQuota;
    case TierKind::kNvme:
      return LimitKind::kNvmeQuota;
    case TierKind::kDevice:
      return LimitKind::kDeviceQuota;
  }
  return LimitKind::kHostQuota;
}

bool Empty(const TenantUsage& u) {
  return u.chunks == 0 && u.schedule_accesses == 0 &&
         std::all_of(u.bytes.begin(), u.bytes.end(), [](uint64_t b) { return b == 0; }) &&
         std::all_of(u.refusals.begin(), u.refusals.end(), [](uint64_t r) { return r == 0; });
}

}  // namespace

const char* LimitName(LimitKind kind) {
  switch (kind) {
    case LimitKind::kHostQuota:
      return "quota.host";
    case LimitKind::kNvmeQuota:
      return "quota.nvme";
    case LimitKind::kDeviceQuota:
      return "quota.device";
    case LimitKind::kChunksPerSession:
      return "limits.chunks_per_session";
    case LimitKind::kChunksPerUid:
      return "limits.chunks_per_uid";
    case LimitKind::kScheduleAccessesPerSession:
      return "limits.schedule_accesses_per_session";
    case LimitKind::kScheduleAccessesPerUid:
      return "limits.schedule_accesses_per_uid";
    case LimitKind::kTraceSteps:
      return "limits.trace_steps";
  }
  return "?";
}

absl::Status TenantLedger::Refuse(uint32_t uid, LimitKind kind, std::string message) {
  ++usage_[uid].refusals[static_cast<int>(kind)];
  return absl::ResourceExhaustedError(std::move(message));
}

void TenantLedger::ForgetIfEmpty(uint32_t uid) {
  auto it = usage_.find(uid);
  if (it != usage_.end() && Empty(it->second)) usage_.erase(it);
}

uint64_t TenantLedger::Headroom(uint32_t uid, TierKind tier) const {
  const uint64_t quota = quotas_.For(uid)[tier];
  if (quota == 0) return UINT64_MAX;
  auto it = usage_.find(uid);
  const uint64_t held = it == usage_.end() ? 0 : it->second.bytes[tier];
  return quota - std::min(quota, held);
}

absl::Status TenantLedger::CheckBytes(uint32_t uid, TierKind tier, uint64_t bytes) {
  if (bytes <= Headroom(uid, tier)) return absl::OkStatus();
  const uint64_t quota = quotas_.For(uid)[tier];
  const LimitKind kind = QuotaKind(tier);
  return Refuse(
      uid, kind,
      absl::StrCat("uid ", uid, " holds ", FormatSize(quota - Headroom(uid, tier)), " of the ",
                   TierName(tier), " tier; ", FormatSize(bytes), " more would pass its quota of ",
                   FormatSize(quota), " (", LimitName(kind),
                   "). Free or evict some of its chunks, or ask the "
                   "operator for a larger quota"));
}

void TenantLedger::AddBytes(uint32_t uid, TierKind tier, uint64_t bytes) {
  usage_[uid].bytes[tier] += bytes;
}

void TenantLedger::RemoveBytes(uint32_t uid, TierKind tier, uint64_t bytes) {
  auto it = usage_.find(uid);
  if (it == usage_.end()) return;
  uint64_t& held = it->second.bytes[tier];
  held -= std::min(held, bytes);
  ForgetIfEmpty(uid);
}

absl::Status TenantLedger::CheckChunks(uint32_t uid, uint64_t session_chunks, uint64_t more) {
  if (session_chunks + more > limits_.chunks_per_session) {
    return Refuse(
        uid, LimitKind::kChunksPerSession,
        absl::StrCat("the session holds ", session_chunks, " chunks; ", more,
                     " more would pass limits.chunks_per_session (", limits_.chunks_per_session,
                     "). Free some, or pack tensors into "
                     "fewer, larger chunks"));
  }
  const uint64_t held = UsageOf(uid).chunks;
  if (held + more > limits_.chunks_per_uid) {
    return Refuse(
        uid, LimitKind::kChunksPerUid,
        absl::StrCat("uid ", uid, " holds ", held, " chunks (scratch and persistent); ", more,
                     " more would pass limits.chunks_per_uid (", limits_.chunks_per_uid,
                     "). Free some, or pack tensors into "
                     "fewer, larger chunks"));
  }
  return absl::OkStatus();
}

void TenantLedger::AddChunks(uint32_t uid, int64_t delta) {
  uint64_t& chunks = usage_[uid].chunks;
  chunks = delta >= 0 ? chunks + static_cast<uint64_t>(delta)
                      : chunks - std::min(chunks, static_cast<uint64_t>(-delta));
  ForgetIfEmpty(uid);
}

absl::Status TenantLedger::CheckSchedule(uint32_t uid, uint64_t replaced, uint64_t accesses,
                                         const char* what) {
  if (accesses > limits_.schedule_accesses_per_session) {
    return Refuse(uid, LimitKind::kScheduleAccessesPerSession,
                  absl::StrCat(what, ": ", accesses,
                               " accesses (or steps) pass limits.schedule_accesses_per_session (",
                               limits_.schedule_accesses_per_session, ")"));
  }
  const uint64_t held = UsageOf(uid).schedule_accesses;
  const uint64_t after = held - std::min(held, replaced) + accesses;
  if (after > limits_.schedule_accesses_per_uid) {
    return Refuse(uid, LimitKind::kScheduleAccessesPerUid,
                  absl::StrCat(what, ": uid ", uid, "'s schedules would hold ", after,
                               " accesses, more than limits.schedule_accesses_per_uid (",
                               limits_.schedule_accesses_per_uid, ")"));
  }
  return absl::OkStatus();
}

absl::Status TenantLedger::CheckTrace(uint32_t uid, uint64_t steps) {
  if (steps <= limits_.trace_steps) return absl::OkStatus();
  return Refuse(uid, LimitKind::kTraceSteps,
                absl::StrCat("SetSchedule: a trace of ", steps,
                             " steps passes limits.trace_steps (", limits_.trace_steps, ")"));
}

void TenantLedger::AddScheduleAccesses(uint32_t uid, int64_t delta) {
  uint64_t& accesses = usage_[uid].schedule_accesses;
  accesses = delta >= 0 ? accesses + static_cast<uint64_t>(delta)
                        : accesses - std::min(accesses, static_cast<uint64_t>(-delta));
  ForgetIfEmpty(uid);
}

std::map<uint32_t, TenantUsage> TenantLedger::Usage() const {
  return std::map<uint32_t, TenantUsage>(usage_.begin(), usage_.end());
}

TenantUsage TenantLedger::UsageOf(uint32_t uid) const {
  auto it = usage_.find(uid);
  return it == usage_.end() ? TenantUsage{} : it->second;
}

}  // namespace tierd::daemon
