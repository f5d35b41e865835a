// Client's calls about the node and the session's place on it: the node's status, draining a
// tier, and the session's schedules, version bits, figures and bandwidth weight
// (docs/schedules.md).
#include "client/client_impl.h"

namespace tierd {

using client_internal::FromProto;
using client_internal::ToProto;

const TierStatus* NodeInfo::tier(Tier t) const {
  for (const TierStatus& s : tiers) {
    if (s.tier == t) return &s;
  }
  return nullptr;
}

const PathStatus* NodeInfo::path(std::string_view name) const {
  for (const PathStatus& p : paths) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

absl::StatusOr<NodeInfo> Client::GetNodeInfo(bool list_sessions) {
  pb::GetNodeInfoRequest req;
  req.set_list_sessions(list_sessions);
  pb::GetNodeInfoResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::GetNodeInfo, req, &resp, "GetNodeInfo");
      !s.ok()) {
    return s;
  }
  NodeInfo info;
  info.hostname = resp.hostname();
  info.version = resp.build().version();
  info.cuda = resp.build().cuda();
  for (const pb::TierInfo& t : resp.tiers()) {
    TierStatus status{
        FromProto(t.tier()), t.configured(),         t.capacity_bytes(), t.used_bytes(),
        t.free_bytes(),      t.largest_free_bytes(), t.detail(),         {}};
    for (const pb::RegionInfo& r : t.regions()) {
      status.regions.push_back({r.path(), r.capacity_bytes(), r.used_bytes(), r.block_size()});
    }
    status.io_backend = t.io_backend();
    status.persistent_granule_bytes = t.persistent_granule_bytes();
    status.segment_bytes = t.segment_bytes();
    info.tiers.push_back(std::move(status));
  }
  for (const pb::DeviceInfo& d : resp.devices()) {
    info.devices.push_back(absl::StrCat(d.uuid(), " ", d.name(), " (", d.memory_bytes(), " B)"));
  }
  if (resp.devices_size() > 0) {
    info.device_uuid = resp.devices(0).uuid();
    info.device_emulated = resp.devices(0).emulated();
    info.device_memory_bytes = resp.devices(0).memory_bytes();
  }
  info.device_status = resp.device_status();
  for (const pb::Fallback& f : resp.fallbacks()) info.fallbacks.emplace_back(f.what(), f.why());
  info.uptime_seconds = resp.uptime_seconds();
  for (const pb::SessionInfo& x : resp.session_list()) {
    info.session_list.push_back({x.id(), x.client_name(), x.uid(), x.pid(),
                                 absl::FromUnixSeconds(x.opened_unix_seconds()), x.chunks(),
                                 x.bytes(), x.pinned_chunks(), x.job(), x.moved_bytes()});
  }
  info.sessions = resp.sessions();
  info.chunks = resp.chunks();
  for (const pb::PathInfo& p : resp.paths()) {
    info.paths.push_back({p.name(), p.bytes_total(), p.moves_total(), p.bytes_per_second(),
                          p.measured(), p.probed_bytes_per_second()});
  }
  for (const pb::TenantInfo& t : resp.tenants()) {
    TenantStatus& out = info.tenants.emplace_back();
    out.uid = t.uid();
    out.user = t.user();
    out.sessions = t.sessions();
    out.chunks = t.chunks();
    out.schedule_accesses = t.schedule_accesses();
    for (const pb::TenantTier& tier : t.tiers()) {
      out.tiers.push_back({FromProto(tier.tier()), tier.used_bytes(), tier.quota_bytes()});
    }
    for (const pb::LimitRefusals& r : t.refusals()) out.refusals.emplace_back(r.limit(), r.count());
  }
  const pb::LimitsInfo& l = resp.limits();
  info.limits = {l.connections_per_uid(),
                 l.sessions_per_uid(),
                 l.chunks_per_session(),
                 l.chunks_per_uid(),
                 l.schedule_accesses_per_session(),
                 l.schedule_accesses_per_uid(),
                 l.trace_steps()};
  return info;
}

absl::StatusOr<DrainStarted> Client::Drain(Tier tier, std::span<const ChunkId> ids) {
  pb::DrainRequest req;
  req.set_tier(ToProto(tier));
  for (ChunkId id : ids) req.add_chunk_ids(id);
  pb::DrainResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Drain, req, &resp, "Drain"); !s.ok()) {
    return s;
  }
  return DrainStarted{.done = {resp.completion().slot(), resp.completion().sequence()},
                      .chunks = resp.chunks(),
                      .bytes = resp.bytes(),
                      .pinned_chunks = resp.pinned_chunks()};
}

absl::Status Client::SetSchedule(std::span<const ScheduleStep> steps,
                                 const ScheduleOptions& options) {
  pb::SetScheduleRequest req;
  req.mutable_steps()->Reserve(static_cast<int>(steps.size()));
  for (const ScheduleStep& step : steps) {
    pb::ScheduleStep* out = req.add_steps();
    out->mutable_accesses()->Reserve(static_cast<int>(step.size()));
    for (const StepAccess& a : step) {
      pb::StepAccess* access = out->add_accesses();
      access->set_chunk_id(a.id);
      access->set_tier(ToProto(a.tier));
      access->set_mode(static_cast<pb::AccessMode>(static_cast<int>(a.mode)));
      access->set_other_chunk_id(a.other);
      access->set_version_bit(a.version_bit);
    }
  }
  req.set_host_quota_bytes(options.host_quota_bytes);
  req.set_device_quota_bytes(options.device_quota_bytes);
  pb::SetScheduleResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetSchedule, req, &resp, "SetSchedule");
}

absl::Status Client::TraceSchedule(uint32_t steps_per_iteration, const ScheduleOptions& options) {
  if (steps_per_iteration == 0) {
    return absl::InvalidArgumentError("TraceSchedule: an iteration has at least one step");
  }
  pb::SetScheduleRequest req;
  req.set_trace_steps(steps_per_iteration);
  req.set_host_quota_bytes(options.host_quota_bytes);
  req.set_device_quota_bytes(options.device_quota_bytes);
  pb::SetScheduleResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetSchedule, req, &resp, "SetSchedule");
}

void Client::BeginStep(uint64_t k) {
  impl_->page->header.cursor.store(k + 1, std::memory_order_release);
}

absl::Status Client::SetVersion(uint32_t bit, bool value) {
  if (bit >= kVersionBits) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetVersion: bit ", bit, "; there are ", kVersionBits));
  }
  std::atomic<uint64_t>& word = impl_->page->header.versions[bit / 64];
  const uint64_t mask = uint64_t{1} << (bit % 64);
  if (value) {
    word.fetch_or(mask, std::memory_order_release);
  } else {
    word.fetch_and(~mask, std::memory_order_release);
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionStats> Client::GetSessionStats() {
  pb::GetSessionStatsRequest req;
  pb::GetSessionStatsResponse resp;
  if (absl::Status s =
          impl_->Call(&pb::Tierd::Stub::GetSessionStats, req, &resp, "GetSessionStats");
      !s.ok()) {
    return s;
  }
  SessionStats stats;
  stats.acquired_ready = resp.acquired_ready();
  stats.acquired_waited = resp.acquired_waited();
  for (const pb::TierStall& t : resp.stalls()) {
    const absl::Duration d = absl::Seconds(t.stall_seconds());
    if (t.tier() == pb::TIER_HOST) stats.host_stall = d;
    if (t.tier() == pb::TIER_DEVICE) stats.device_stall = d;
  }
  stats.planner_fetches = resp.planner_fetches();
  stats.planner_drops = resp.planner_drops();
  stats.planner_write_backs = resp.planner_write_backs();
  stats.cursor = resp.cursor();
  stats.schedule_steps = resp.schedule_steps();
  stats.tracing = resp.tracing();
  stats.bandwidth_weight = resp.bandwidth_weight();
  return stats;
}

absl::Status Client::SetBandwidthWeight(uint32_t weight) {
  pb::SetBandwidthWeightRequest req;
  req.set_weight(weight);
  pb::SetBandwidthWeightResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetBandwidthWeight, req, &resp, "SetBandwidthWeight");
}

}  // namespace tierd
