#include "daemon/api/daemon_metrics.h"

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "daemon/api/importer.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/device/device_probe.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "daemon/util/fallbacks.h"
#include "daemon/util/metrics.h"

namespace tierd::daemon {
namespace {

using metrics::Labels;
using Type = prometheus::MetricType;

constexpr TierKind kTiers[] = {TierKind::kDevice, TierKind::kHost, TierKind::kNvme};

Labels TierLabel(TierKind t) { return {{"tier", std::string(TierName(t))}}; }

// A path's labels; the paths over PCIe also name the GPU, so that bandwidth is per device.
Labels PathLabel(Path path, const std::string& gpu) {
  Labels labels{{"path", PathName(path)}};
  if (!gpu.empty() && (path == Path::kHostToDevice || path == Path::kDeviceToHost)) {
    labels.push_back({"device", gpu});
  }
  return labels;
}

}  // namespace

absl::string_view GrpcCodeName(int code) {
  static constexpr absl::string_view kNames[] = {"OK",
                                                 "CANCELLED",
                                                 "UNKNOWN",
                                                 "INVALID_ARGUMENT",
                                                 "DEADLINE_EXCEEDED",
                                                 "NOT_FOUND",
                                                 "ALREADY_EXISTS",
                                                 "PERMISSION_DENIED",
                                                 "RESOURCE_EXHAUSTED",
                                                 "FAILED_PRECONDITION",
                                                 "ABORTED",
                                                 "OUT_OF_RANGE",
                                                 "UNIMPLEMENTED",
                                                 "INTERNAL",
                                                 "UNAVAILABLE",
                                                 "DATA_LOSS",
                                                 "UNAUTHENTICATED"};
  return code >= 0 && code < 17 ? kNames[code] : "UNKNOWN";
}

RpcMetrics::RpcMetrics()
    : requests_(prometheus::BuildCounter()
                    .Name("tierd_requests_total")
                    .Help("API requests by operation and gRPC status code (code!=\"OK\" are "
                          "errors).")
                    .Register(registry_)),
      seconds_(prometheus::BuildHistogram()
                   .Name("tierd_request_seconds")
                   .Help("How long API requests took, by operation.")
                   .Register(registry_)) {}

void RpcMetrics::Record(absl::string_view op, int grpc_code, absl::Duration took) {
  // Bounded: the operations are the API's, the codes gRPC's.
  static const prometheus::Histogram::BucketBoundaries kBuckets =
      metrics::ExponentialBuckets(25e-6, 2, 16);  // 25 us to 0.8 s, doubling
  requests_.Add({{"op", std::string(op)}, {"code", std::string(GrpcCodeName(grpc_code))}})
      .Increment();
  seconds_.Add({{"op", std::string(op)}}, kBuckets).Observe(absl::ToDoubleSeconds(took));
}

std::string RenderMetrics(const MetricsSources& src) {
  metrics::Families w;
  w.Family("tierd_build_info", Type::Gauge, "The running daemon's version and build (always 1).");
  w.Sample({{"version", TIERD_VERSION},
            {"build_type", TIERD_BUILD_TYPE},
#ifdef TIERD_HAVE_CUDA
            {"cuda", "true"}},
#else
            {"cuda", "false"}},
#endif
           1);
  w.Family("tierd_start_time_seconds", Type::Gauge, "When the daemon started, in Unix time.");
  w.Sample({}, absl::ToDoubleSeconds(src.started - absl::UnixEpoch()));
  if (src.fallbacks != nullptr) {
    w.Family("tierd_fallback", Type::Gauge,
             "Something the daemon runs without because this machine does not allow it (1 while "
             "it holds; why is in tierctl status and the start-up log): nvme_io_threads, "
             "host_small_pages, host_segments_unregistered.");
    for (const auto& [what, why] : src.fallbacks->List()) w.Sample({{"what", what}}, 1);
  }
  if (src.importer != nullptr) {
    const ImportStats imports = src.importer->stats();
    w.Family("tierd_imports_total", Type::Counter,
             "Imports (a client's file read by the daemon into its chunk) ended, by status code.");
    for (const auto& [code, n] : imports.imports) {
      w.Sample({{"code", std::string(GrpcCodeName(static_cast<int>(code)))}},
               static_cast<double>(n));
    }
    w.Family("tierd_import_bytes_total", Type::Counter,
             "Bytes imports read from clients' files, with O_DIRECT or through the page cache.");
    w.Sample({{"direct", "true"}}, static_cast<double>(imports.bytes_direct));
    w.Sample({{"direct", "false"}}, static_cast<double>(imports.bytes_buffered));
  }
  w.Family("tierd_sessions", Type::Gauge, "Client sessions open now.");
  w.Sample({}, static_cast<double>(src.sessions->size()));
  if (src.devices != nullptr) {
    w.Family("tierd_device_info", Type::Gauge,
             "The device tier's GPU (always 1): its UUID, name and whether it is emulated.");
    for (const DeviceDescription& d : src.devices->devices) {
      w.Sample({{"device", d.uuid}, {"name", d.name}, {"emulated", d.emulated ? "true" : "false"}},
               1);
    }
  }

  // Tiers.
  const NodeStats node = src.chunks->node_stats();
  w.Family("tierd_tier_capacity_bytes", Type::Gauge, "Bytes each tier holds in all.");
  std::vector<std::pair<TierKind, TierUsage>> usage;
  for (TierKind t : kTiers) {
    if (const Tier* tier = src.chunks->tier(t); tier != nullptr)
      usage.emplace_back(t, tier->Usage());
  }
  for (const auto& [t, u] : usage) w.Sample(TierLabel(t), static_cast<double>(u.capacity_bytes));
  w.Family("tierd_tier_used_bytes", Type::Gauge,
           "Bytes of each tier reserved by chunks (resident copies and room held for them).");
  for (const auto& [t, u] : usage) w.Sample(TierLabel(t), static_cast<double>(u.used_bytes));
  w.Family("tierd_tier_largest_free_bytes", Type::Gauge,
           "The largest chunk each tier can place now (below the free bytes when space is in "
           "pieces).");
  for (const auto& [t, u] : usage)
    w.Sample(TierLabel(t), static_cast<double>(u.largest_free_bytes));
  w.Family("tierd_tier_resident_bytes", Type::Gauge, "Bytes of valid chunk copies in each tier.");
  for (const auto& [t, u] : usage) {
    w.Sample(TierLabel(t), static_cast<double>(node.resident_bytes[t]));
  }
  w.Family("tierd_tier_pinned_bytes", Type::Gauge,
           "Space in each tier held by acquired chunks: not reclaimable until they are released.");
  for (const auto& [t, u] : usage) {
    w.Sample(TierLabel(t), static_cast<double>(node.pinned_bytes[t]));
  }
  w.Family("tierd_tier_resident_chunks", Type::Gauge, "Chunks with a valid copy in each tier.");
  for (const auto& [t, u] : usage) {
    w.Sample(TierLabel(t), static_cast<double>(node.resident_chunks[t]));
  }
  w.Family("tierd_chunks", Type::Gauge, "Chunks by state: ready, or moving between tiers.");
  w.Sample({{"state", "ready"}}, static_cast<double>(node.chunks_ready));
  w.Sample({{"state", "moving"}}, static_cast<double>(node.chunks_moving));
  w.Family("tierd_chunks_pinned", Type::Gauge, "Chunks acquired (pinned) by a session now.");
  w.Sample({}, static_cast<double>(node.chunks_pinned));
  w.Family("tierd_chunks_persistent", Type::Gauge, "Persistent (named) chunks.");
  w.Sample({}, static_cast<double>(node.chunks_persistent));
  w.Family("tierd_shared_bases", Type::Gauge,
           "Shared bases: read-only sets of chunks that every job allowed to opens (one copy per "
           "node).");
  w.Sample({}, static_cast<double>(node.shared_bases));
  w.Family("tierd_shared_base_holders", Type::Gauge,
           "Sessions holding a shared base, summed over the bases.");
  w.Sample({}, static_cast<double>(node.shared_base_holders));
  w.Family("tierd_shared_base_bytes", Type::Gauge,
           "Bytes of shared bases' copies in each tier, counted once however many jobs hold them.");
  for (const auto& [t, u] : usage) {
    w.Sample(TierLabel(t), static_cast<double>(node.shared_base_bytes[t]));
  }

  // Moves between tiers.
  const PathArray<PathStatus> paths = src.chunks->path_status();
  const std::string gpu = src.devices != nullptr && !src.devices->devices.empty()
                              ? src.devices->devices.front().uuid
                              : std::string();
  auto PathLabel = [&gpu](Path p) { return daemon::PathLabel(p, gpu); };
  w.Family("tierd_moved_bytes_total", Type::Counter,
           "Bytes moved between tiers by path: nvme_to_host and host_to_nvme are the drives' read "
           "and write, host_to_device and device_to_host PCIe H2D and D2H.");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), static_cast<double>(paths[p].bytes));
  w.Family("tierd_moves_total", Type::Counter, "Chunk moves completed, by path.");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), static_cast<double>(paths[p].moves));
  w.Family("tierd_path_bandwidth_bytes_per_second", Type::Gauge,
           "Each path's bandwidth as the planner estimates it (measured from moves, or probed at "
           "start-up).");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), paths[p].bytes_per_second);
  w.Family("tierd_path_probed_bandwidth_bytes_per_second", Type::Gauge,
           "Each path's bandwidth measured by the start-up probe (0: not probed).");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), paths[p].probed_bytes_per_second);
  w.Family("tierd_moves_in_flight", Type::Gauge, "Chunk moves under way, by path.");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), static_cast<double>(node.in_flight[p]));
  w.Family("tierd_move_queued_bytes", Type::Gauge, "Bytes of the moves under way, by path.");
  for (Path p : kAllPaths) w.Sample(PathLabel(p), static_cast<double>(node.queued_bytes[p]));
  w.Family("tierd_transfer_seconds", Type::Histogram,
           "How long chunk moves took, from start to settling (queueing included), by path.");
  for (Path p : kAllPaths) {
    w.Sample(PathLabel(p), src.chunks->transfer_seconds(p));
  }

  // What acquisitions cost, and what the planner did about it.
  w.Family("tierd_acquires_total", Type::Counter,
           "Chunks acquired: result=ready found in place (a prefetch hit), result=waited had to "
           "be brought in (a miss).");
  w.Sample({{"result", "ready"}}, static_cast<double>(node.totals.ready));
  w.Sample({{"result", "waited"}}, static_cast<double>(node.totals.waited));
  w.Family("tierd_acquire_stall_seconds_total", Type::Counter,
           "Time acquisitions waited for their chunks to arrive (or for room), by tier.");
  for (const auto& [t, u] : usage) {
    w.Sample(TierLabel(t), absl::ToDoubleSeconds(node.totals.stall[t]));
  }
  w.Family("tierd_acquire_wait_seconds", Type::Histogram,
           "How long acquisitions whose chunk was not in place waited for it to arrive, by tier.");
  for (const auto& [t, u] : usage) w.Sample(TierLabel(t), src.chunks->acquire_wait_seconds(t));
  w.Family("tierd_planner_moves_total", Type::Counter,
           "Moves the planner started ahead of need, by kind.");
  w.Sample({{"kind", "fetch"}}, static_cast<double>(node.totals.planner_fetches));
  w.Sample({{"kind", "drop"}}, static_cast<double>(node.totals.planner_drops));
  w.Sample({{"kind", "write_back"}}, static_cast<double>(node.totals.planner_write_backs));

  // The NVMe tier's drives.
  if (src.nvme != nullptr) {
    const IoEngineStats io = src.nvme->stats();
    const std::vector<RegionStatus> regions = src.nvme->Regions();
    auto region = [&](size_t i) { return Labels{{"region", regions[i].path}}; };
    auto by_file = [](const std::vector<uint64_t>& v, size_t i) {
      return static_cast<double>(i < v.size() ? v[i] : 0);
    };
    w.Family("tierd_nvme_region_capacity_bytes", Type::Gauge, "Each NVMe region's data area.");
    for (size_t i = 0; i < regions.size(); ++i) {
      w.Sample(region(i), static_cast<double>(regions[i].capacity_bytes));
    }
    w.Family("tierd_nvme_region_used_bytes", Type::Gauge, "Bytes of each NVMe region in use.");
    for (size_t i = 0; i < regions.size(); ++i) {
      w.Sample(region(i), static_cast<double>(regions[i].used_bytes));
    }
    w.Family("tierd_nvme_read_bytes_total", Type::Counter, "Bytes read from each NVMe region.");
    for (size_t i = 0; i < regions.size(); ++i) w.Sample(region(i), by_file(io.file_bytes_read, i));
    w.Family("tierd_nvme_written_bytes_total", Type::Counter, "Bytes written to each NVMe region.");
    for (size_t i = 0; i < regions.size(); ++i) {
      w.Sample(region(i), by_file(io.file_bytes_written, i));
    }
    w.Family("tierd_nvme_io_errors_total", Type::Counter,
             "NVMe I/Os that failed (each fails its request).");
    w.Sample({}, static_cast<double>(io.errors));
    w.Family("tierd_nvme_checksum_failures_total", Type::Counter,
             "Chunk reads from NVMe whose bytes failed their checksum: damaged data, refused with "
             "DATA_LOSS and never handed out.");
    w.Sample({}, static_cast<double>(src.nvme->checksum_failures()));
    w.Family("tierd_nvme_short_transfers_total", Type::Counter,
             "NVMe I/Os that moved fewer bytes than asked (continued where they stopped).");
    w.Sample({}, static_cast<double>(io.short_transfers));
    w.Family("tierd_nvme_io_in_flight", Type::Gauge, "io_uring requests in flight now.");
    w.Sample({}, static_cast<double>(io.in_flight));
    w.Family("tierd_nvme_io_backend", Type::Gauge,
             "How the NVMe tier does its I/O (always 1): io_uring, or threads of pread/pwrite "
             "where io_uring is unavailable or turned off.");
    w.Sample({{"backend", IoBackendName(src.nvme->io_backend())}}, 1);
    w.Family("tierd_nvme_io_queue_depth", Type::Gauge,
             "The most io_uring requests kept in flight (nvme.queue_depth).");
    w.Sample({}, static_cast<double>(src.nvme->queue_depth()));
    w.Family("tierd_nvme_io_jobs_queued", Type::Gauge,
             "Transfers waiting for or holding the drive's queue.");
    w.Sample({}, static_cast<double>(io.jobs_queued));
  }

  // Users: what each holds against its quotas, and what passing a limit cost it. A user appears
  // once it holds anything (uids are few on a node: a bounded label).
  const std::map<uint32_t, TenantUsage> tenants = src.chunks->tenant_usage();
  const Quotas quotas = src.chunks->quotas();
  const absl::flat_hash_map<uint32_t, uint32_t> sessions_by_uid = src.sessions->CountByUid();
  auto uid_label = [](uint32_t uid) { return Labels{{"uid", absl::StrCat(uid)}}; };
  w.Family("tierd_user_sessions", Type::Gauge, "Sessions each user has open.");
  for (const auto& [uid, n] : sessions_by_uid) w.Sample(uid_label(uid), n);
  w.Family("tierd_user_chunks", Type::Gauge, "Chunks each user holds (scratch and persistent).");
  for (const auto& [uid, u] : tenants) w.Sample(uid_label(uid), static_cast<double>(u.chunks));
  w.Family("tierd_user_bytes", Type::Gauge, "Bytes of each tier each user's chunks hold.");
  for (const auto& [uid, u] : tenants) {
    for (const auto& [t, tier_usage] : usage) {
      w.Sample({{"uid", absl::StrCat(uid)}, {"tier", std::string(TierName(t))}},
               static_cast<double>(u.bytes[t]));
    }
  }
  w.Family("tierd_user_quota_bytes", Type::Gauge,
           "Each user's quota in each tier (quota.*), where it has one.");
  for (const auto& [uid, u] : tenants) {
    for (const auto& [t, tier_usage] : usage) {
      const uint64_t quota = quotas.For(uid)[t];
      if (quota == 0) continue;
      w.Sample({{"uid", absl::StrCat(uid)}, {"tier", std::string(TierName(t))}},
               static_cast<double>(quota));
    }
  }
  w.Family("tierd_limit_refusals_total", Type::Counter,
           "Requests refused (RESOURCE_EXHAUSTED) for passing a limit or quota, by user and the "
           "limit's config key.");
  for (const auto& [uid, u] : tenants) {
    for (int k = 0; k < kLimitKinds; ++k) {
      if (u.refusals[k] == 0) continue;
      w.Sample({{"uid", absl::StrCat(uid)}, {"limit", LimitName(static_cast<LimitKind>(k))}},
               static_cast<double>(u.refusals[k]));
    }
  }

  // Jobs: what the sessions of each declared job hold and moved, so that one job's traffic on a
  // shared node can be told from another's (at most kMaxLiveJobs jobs: a bounded label).
  const absl::flat_hash_map<std::string, uint32_t> sessions_by_job = src.sessions->CountByJob();
  std::map<std::string, SessionHoldings> held_by_job;
  const std::map<SessionId, SessionHoldings> holdings = src.chunks->Holdings();
  for (const std::shared_ptr<Session>& s : src.sessions->All()) {
    if (s->job.empty()) continue;
    SessionHoldings& j = held_by_job[s->job];
    if (auto h = holdings.find(s->id); h != holdings.end()) {
      j.chunks += h->second.chunks;
      j.bytes += h->second.bytes;
    }
  }
  auto job_label = [](const std::string& job) { return Labels{{"job_name", job}}; };
  w.Family("tierd_job_sessions", Type::Gauge, "Sessions open in each declared job.");
  for (const auto& [job, n] : sessions_by_job) w.Sample(job_label(job), n);
  w.Family("tierd_job_chunks", Type::Gauge,
           "Chunks the sessions of each job hold (scratch, and persistent ones they hold a lease "
           "on).");
  for (const auto& [job, h] : held_by_job) w.Sample(job_label(job), static_cast<double>(h.chunks));
  w.Family("tierd_job_bytes", Type::Gauge, "Bytes of the chunks the sessions of each job hold.");
  for (const auto& [job, h] : held_by_job) w.Sample(job_label(job), static_cast<double>(h.bytes));
  w.Family("tierd_job_moved_bytes_total", Type::Counter,
           "Bytes of each job's chunks moved between tiers, by path (from the job's first "
           "session's first request; a job is forgotten when its last session ends).");
  for (const auto& [job, moved] : src.chunks->JobTraffic()) {
    for (Path p : kAllPaths) {
      w.Sample({{"job_name", job}, {"path", PathName(p)}}, static_cast<double>(moved[p]));
    }
  }

  // The API.
  w.Append(src.rpc->Collect());
  return metrics::Serialize(w.families());
}

}  // namespace tierd::daemon
