#include "daemon/api/node_info.h"

#include <unistd.h>

#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/version.h"
#ifdef TIERD_HAVE_CUDA
#include <cuda.h>
#endif

namespace tierd::daemon {
namespace {

namespace pb = ::tierd::v1;

// The caller's own user, or every user holding anything for an operator.
void AddTenants(const RpcServerDeps& deps, const Session& session, pb::GetNodeInfoResponse* out) {
  const Limits limits = deps.chunks->limits();
  const Quotas quotas = deps.chunks->quotas();
  pb::LimitsInfo* l = out->mutable_limits();
  l->set_connections_per_uid(limits.connections_per_uid);
  l->set_sessions_per_uid(limits.sessions_per_uid);
  l->set_chunks_per_session(limits.chunks_per_session);
  l->set_chunks_per_uid(limits.chunks_per_uid);
  l->set_schedule_accesses_per_session(limits.schedule_accesses_per_session);
  l->set_schedule_accesses_per_uid(limits.schedule_accesses_per_uid);
  l->set_trace_steps(limits.trace_steps);
  std::map<uint32_t, TenantUsage> usage;
  if (IsOperator(session)) {
    usage = deps.chunks->tenant_usage();
  } else {
    usage[session.peer.uid] = deps.chunks->tenant_usage(session.peer.uid);
  }
  const absl::flat_hash_map<uint32_t, uint32_t> sessions = deps.sessions->CountByUid();
  for (const auto& [uid, n] : sessions) {
    if (IsOperator(session) || uid == session.peer.uid) usage.try_emplace(uid);
  }
  for (const auto& [uid, u] : usage) {
    pb::TenantInfo* t = out->add_tenants();
    t->set_uid(uid);
    if (auto name = quotas.names.find(uid); name != quotas.names.end()) t->set_user(name->second);
    if (auto n = sessions.find(uid); n != sessions.end()) t->set_sessions(n->second);
    t->set_chunks(u.chunks);
    t->set_schedule_accesses(u.schedule_accesses);
    for (TierKind kind : {TierKind::kDevice, TierKind::kHost, TierKind::kNvme}) {
      if (deps.chunks->tier(kind) == nullptr) continue;
      pb::TenantTier* tier = t->add_tiers();
      tier->set_tier(ToProto(kind));
      tier->set_used_bytes(u.bytes[kind]);
      tier->set_quota_bytes(quotas.For(uid)[kind]);
    }
    for (int k = 0; k < kLimitKinds; ++k) {
      if (u.refusals[k] == 0) continue;
      pb::LimitRefusals* r = t->add_refusals();
      r->set_limit(LimitName(static_cast<LimitKind>(k)));
      r->set_count(u.refusals[k]);
    }
  }
}

}  // namespace

void ReportNode(const RpcServerDeps& deps, const Session& session, bool list_sessions,
                absl::Time started, pb::GetNodeInfoResponse* out) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  out->set_hostname(host);
  pb::BuildInfo* build = out->mutable_build();
  build->set_version(TIERD_VERSION);
  build->set_build_type(TIERD_BUILD_TYPE);
#ifdef TIERD_HAVE_CUDA
  build->set_cuda(true);
  build->set_cuda_version(absl::StrCat(CUDA_VERSION / 1000, ".", (CUDA_VERSION % 1000) / 10));
#endif
  build->set_sanitizer(TIERD_SANITIZER);
  build->set_compiler(TIERD_COMPILER);
  for (TierKind kind : {TierKind::kDevice, TierKind::kHost, TierKind::kNvme}) {
    pb::TierInfo* info = out->add_tiers();
    info->set_tier(ToProto(kind));
    Tier* tier = deps.chunks->tier(kind);
    info->set_configured(tier != nullptr);
    if (tier == nullptr) continue;
    TierUsage usage = tier->Usage();
    info->set_capacity_bytes(usage.capacity_bytes);
    info->set_used_bytes(usage.used_bytes);
    info->set_free_bytes(usage.capacity_bytes - usage.used_bytes);
    info->set_largest_free_bytes(usage.largest_free_bytes);
    info->set_detail(tier->Describe());
    if (kind != TierKind::kNvme) info->set_segment_bytes(tier->max_reservation());
    if (kind == TierKind::kNvme && deps.nvme != nullptr) {
      info->set_io_backend(IoBackendName(deps.nvme->io_backend()));
      info->set_persistent_granule_bytes(deps.nvme->persistent_granule());
      for (const RegionStatus& r : deps.nvme->Regions()) {
        pb::RegionInfo* region = info->add_regions();
        region->set_path(r.path);
        region->set_capacity_bytes(r.capacity_bytes);
        region->set_used_bytes(r.used_bytes);
        region->set_free_bytes(r.capacity_bytes - r.used_bytes);
        region->set_block_size(r.block_size);
      }
    }
  }
  for (const PathStatus& path : deps.chunks->path_status()) {
    pb::PathInfo* info = out->add_paths();
    info->set_name(PathName(path.path));
    info->set_bytes_total(path.bytes);
    info->set_moves_total(path.moves);
    info->set_bytes_per_second(path.bytes_per_second);
    info->set_measured(path.measured);
    info->set_probed_bytes_per_second(path.probed_bytes_per_second);
  }
  for (const DeviceDescription& d : deps.devices.devices) {
    pb::DeviceInfo* dev = out->add_devices();
    dev->set_uuid(d.uuid);
    dev->set_name(d.name);
    dev->set_memory_bytes(d.memory_bytes);
    dev->set_emulated(d.emulated);
  }
  out->set_device_status(deps.devices.status);
  if (deps.fallbacks != nullptr) {
    for (const auto& [what, why] : deps.fallbacks->List()) {
      pb::Fallback* f = out->add_fallbacks();
      f->set_what(what);
      f->set_why(why);
    }
  }
  out->set_sessions(static_cast<uint32_t>(deps.sessions->size()));
  if (list_sessions && IsOperator(session)) {
    const std::map<SessionId, SessionHoldings> holdings = deps.chunks->Holdings();
    for (const std::shared_ptr<Session>& s : deps.sessions->All()) {
      pb::SessionInfo* info = out->add_session_list();
      info->set_id(s->id);
      info->set_client_name(s->client_name);
      info->set_job(s->job);
      info->set_uid(s->peer.uid);
      info->set_pid(static_cast<uint32_t>(s->peer.pid));
      info->set_opened_unix_seconds(absl::ToUnixSeconds(s->opened));
      if (auto h = holdings.find(s->id); h != holdings.end()) {
        info->set_chunks(h->second.chunks);
        info->set_bytes(h->second.bytes);
        info->set_pinned_chunks(h->second.pinned);
        info->set_moved_bytes(h->second.moved_bytes);
      }
    }
  }
  AddTenants(deps, session, out);
  out->set_chunks(deps.chunks->chunk_count());
  out->set_uptime_seconds(absl::ToInt64Seconds(absl::Now() - started));
}

}  // namespace tierd::daemon
