// tierctl: what the node is doing: status (tiers, devices, sessions, recent bandwidth), health,
// and shared bases (tierctl.h).

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/sizes.h"
#include "tools/tierctl.h"

namespace tierd {

int Tierctl::Status() {
  absl::Duration sample;
  if (!absl::ParseDuration(Flag("sample", "1s"), &sample) || sample < absl::ZeroDuration()) {
    return Usage("--sample takes a duration such as 1s (0 to skip the bandwidth sample)");
  }
  absl::StatusOr<NodeInfo> before = client_->GetNodeInfo(/*list_sessions=*/true);
  if (!before.ok()) return Fail(before.status(), "GetNodeInfo");
  NodeInfo info = *before;
  std::map<std::string, double> recent;  // bytes per second over the sample, by path
  if (sample > absl::ZeroDuration()) {
    const absl::Time t0 = absl::Now();
    absl::SleepFor(sample);
    absl::StatusOr<NodeInfo> after = client_->GetNodeInfo(/*list_sessions=*/true);
    if (!after.ok()) return Fail(after.status(), "GetNodeInfo");
    const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
    for (const PathStatus& p : after->paths) {
      const PathStatus* was = before->path(p.name);
      recent[p.name] = (p.bytes - (was ? was->bytes : 0)) / seconds;
    }
    info = std::move(*after);
  }
  absl::StatusOr<std::vector<BaseStatus>> bases = client_->ListBases();
  if (!bases.ok()) return Fail(bases.status(), "ListBases");
  if (json_) {
    PrintStatusJson(info, recent, sample, *bases);
  } else {
    PrintStatus(info, recent, sample);
    if (!bases->empty()) {
      std::printf("\n");
      PrintBases(*bases);
    }
  }
  return 0;
}

Json Tierctl::BasesJson(const std::vector<BaseStatus>& bases) {
  Json rows = Json::array();
  for (const BaseStatus& b : bases) {
    rows.push_back({{"name", b.name},
                    {"creator_uid", b.creator_uid},
                    {"group", b.group ? Json(*b.group) : Json()},
                    {"sealed", b.sealed},
                    {"job", b.job.empty() ? Json() : Json(b.job)},
                    {"pinned", b.pinned},
                    {"chunks", b.chunks},
                    {"bytes", b.bytes},
                    {"host_bytes", b.host_bytes},
                    {"nvme_bytes", b.nvme_bytes},
                    {"holders", b.holders}});
  }
  return rows;
}

void Tierctl::PrintBases(const std::vector<BaseStatus>& bases) {
  std::printf("%-28s %7s %-16s %-8s %7s %12s %12s %12s  %s\n", "SHARED BASE", "CREATOR",
              "SHARED WITH", "STATE", "CHUNKS", "BYTES", "IN HOST", "ON NVME", "HOLDERS");
  for (const BaseStatus& b : bases) {
    const std::string with = !b.job.empty() ? absl::StrCat("job ", b.job)
                             : b.group      ? absl::StrCat("group ", *b.group)
                                            : "-";
    std::printf("%-28s %7u %-16s %-8s %7llu %12s %12s %12s  %s\n", b.name.c_str(), b.creator_uid,
                with.c_str(),
                !b.sealed  ? "loading"
                : b.pinned ? "pinned"
                           : "sealed",
                static_cast<unsigned long long>(b.chunks), FormatSize(b.bytes).c_str(),
                FormatSize(b.host_bytes).c_str(), FormatSize(b.nvme_bytes).c_str(),
                b.holders.empty() ? "-" : absl::StrJoin(b.holders, "; ").c_str());
  }
}

int Tierctl::Bases() {
  const std::vector<std::string>& p = args_.positional;
  if (!p.empty()) {
    if (p.size() != 2 || (p[0] != "pin" && p[0] != "unpin")) {
      return Usage("bases takes nothing, or pin NAME, or unpin NAME");
    }
    if (absl::Status s = client_->PinBase(p[1], p[0] == "pin"); !s.ok()) {
      return Fail(s, "PinBase");
    }
  }
  absl::StatusOr<std::vector<BaseStatus>> bases = client_->ListBases();
  if (!bases.ok()) return Fail(bases.status(), "ListBases");
  if (json_) {
    PrintJson(BasesJson(*bases));
  } else if (bases->empty()) {
    std::printf("no shared bases\n");
  } else {
    PrintBases(*bases);
  }
  return 0;
}

void Tierctl::PrintStatus(const NodeInfo& n, const std::map<std::string, double>& recent,
                          absl::Duration sample) const {
  std::printf("tierd %s on %s, up %s, %u session(s), %llu chunk(s)\n", n.version.c_str(),
              n.hostname.c_str(), absl::FormatDuration(absl::Seconds(n.uptime_seconds)).c_str(),
              n.sessions, static_cast<unsigned long long>(n.chunks));
  std::printf("\n%-7s %12s %12s %6s %14s  %s\n", "TIER", "USED", "CAPACITY", "USE", "LARGEST FREE",
              "DETAIL");
  for (const TierStatus& t : n.tiers) {
    if (!t.configured) {
      std::printf("%-7s %12s\n", TierName(t.tier), "(not configured)");
      continue;
    }
    std::printf("%-7s %12s %12s %5.1f%% %14s  %s\n", TierName(t.tier),
                FormatSize(t.used_bytes).c_str(), FormatSize(t.capacity_bytes).c_str(),
                t.capacity_bytes ? 100.0 * t.used_bytes / t.capacity_bytes : 0.0,
                FormatSize(t.largest_free_bytes).c_str(), t.detail.c_str());
    for (const RegionStatus& r : t.regions) {
      std::printf("  region %s: %s of %s\n", r.path.c_str(), FormatSize(r.used_bytes).c_str(),
                  FormatSize(r.capacity_bytes).c_str());
    }
  }
  std::printf("\nDEVICE  ");
  if (n.device_uuid.empty()) {
    std::printf("none (%s)\n", n.device_status.c_str());
  } else {
    std::printf("%s%s, %s\n", n.device_uuid.c_str(), n.device_emulated ? " (emulated)" : "",
                FormatSize(n.device_memory_bytes).c_str());
  }
  if (!n.fallbacks.empty()) {
    std::printf("\nFALLBACKS (what this machine does not allow; tierctl doctor says more)\n");
    for (const auto& [what, why] : n.fallbacks) {
      std::printf("  %-28s %s\n", what.c_str(), why.c_str());
    }
  }
  std::printf("\n%-15s %14s %14s %14s %14s\n", "PATH",
              sample > absl::ZeroDuration()
                  ? absl::StrCat("LAST ", absl::FormatDuration(sample)).c_str()
                  : "RECENT",
              "ESTIMATE", "PROBED", "MOVED");
  for (const PathStatus& p : n.paths) {
    auto r = recent.find(p.name);
    std::printf("%-15s %14s %14s %14s %14s\n", p.name.c_str(),
                r == recent.end() ? "-" : Rate(r->second).c_str(), Rate(p.bytes_per_second).c_str(),
                p.probed_bytes_per_second > 0 ? Rate(p.probed_bytes_per_second).c_str() : "-",
                FormatSize(p.bytes).c_str());
  }
  if (!n.tenants.empty()) {
    // Used/quota per tier ("-" where there is no quota), and what was refused for a limit.
    std::printf("\n%-16s %8s %9s %21s %21s %21s  %s\n", "USER", "SESSIONS", "CHUNKS",
                "DEVICE USED/QUOTA", "HOST USED/QUOTA", "NVME USED/QUOTA", "REFUSED");
    for (const TenantStatus& t : n.tenants) {
      std::string cells[4];  // by Tier
      for (const TenantStatus::TierUse& u : t.tiers) {
        cells[static_cast<int>(u.tier)] =
            absl::StrCat(FormatSize(u.used_bytes), "/",
                         u.quota_bytes ? FormatSize(u.quota_bytes) : std::string("-"));
      }
      std::vector<std::string> refused;
      for (const auto& [limit, count] : t.refusals)
        refused.push_back(absl::StrCat(limit, " ", count));
      const std::string who =
          t.user.empty() ? absl::StrCat("uid ", t.uid) : absl::StrCat(t.user, " (", t.uid, ")");
      std::printf("%-16s %8u %9llu %21s %21s %21s  %s\n", who.c_str(), t.sessions,
                  static_cast<unsigned long long>(t.chunks),
                  cells[static_cast<int>(Tier::kDevice)].c_str(),
                  cells[static_cast<int>(Tier::kHost)].c_str(),
                  cells[static_cast<int>(Tier::kNvme)].c_str(),
                  refused.empty() ? "-" : absl::StrJoin(refused, ", ").c_str());
    }
    const LimitsStatus& l = n.limits;
    std::printf(
        "limits per user: %u sessions, %u connections, %llu chunks, %llu schedule accesses; "
        "per session: %llu chunks, %llu schedule accesses, %u trace steps\n",
        l.sessions_per_uid, l.connections_per_uid,
        static_cast<unsigned long long>(l.chunks_per_uid),
        static_cast<unsigned long long>(l.schedule_accesses_per_uid),
        static_cast<unsigned long long>(l.chunks_per_session),
        static_cast<unsigned long long>(l.schedule_accesses_per_session), l.trace_steps);
  }
  if (!n.session_list.empty()) {
    std::printf("\n%-8s %-20s %-16s %7s %8s %8s %12s %7s %12s  %s\n", "SESSION", "CLIENT", "JOB",
                "UID", "PID", "CHUNKS", "BYTES", "PINNED", "MOVED", "OPENED");
    for (const SessionSummary& s : n.session_list) {
      std::printf("%-8llu %-20s %-16s %7u %8u %8llu %12s %7llu %12s  %s\n",
                  static_cast<unsigned long long>(s.id), s.client_name.c_str(),
                  s.job.empty() ? "-" : s.job.c_str(), s.uid, s.pid,
                  static_cast<unsigned long long>(s.chunks), FormatSize(s.bytes).c_str(),
                  static_cast<unsigned long long>(s.pinned_chunks),
                  FormatSize(s.moved_bytes).c_str(),
                  absl::FormatTime("%Y-%m-%d %H:%M:%S", s.opened, absl::LocalTimeZone()).c_str());
    }
  }
}

void Tierctl::PrintStatusJson(const NodeInfo& n, const std::map<std::string, double>& recent,
                              absl::Duration sample, const std::vector<BaseStatus>& bases) const {
  Json device = n.device_uuid.empty() ? Json{{"uuid", nullptr}, {"status", n.device_status}}
                                      : Json{{"uuid", n.device_uuid},
                                             {"emulated", n.device_emulated},
                                             {"memory_bytes", n.device_memory_bytes}};
  Json tiers = Json::array();
  for (const TierStatus& t : n.tiers) {
    Json regions = Json::array();
    for (const RegionStatus& r : t.regions) {
      regions.push_back(
          {{"path", r.path}, {"capacity_bytes", r.capacity_bytes}, {"used_bytes", r.used_bytes}});
    }
    Json tier = {{"tier", TierName(t.tier)},
                 {"configured", t.configured},
                 {"capacity_bytes", t.capacity_bytes},
                 {"used_bytes", t.used_bytes},
                 {"free_bytes", t.free_bytes},
                 {"largest_free_bytes", t.largest_free_bytes},
                 {"detail", t.detail}};
    if (!t.io_backend.empty()) tier["io_backend"] = t.io_backend;
    tier["regions"] = std::move(regions);
    tiers.push_back(std::move(tier));
  }
  Json paths = Json::array();
  for (const PathStatus& p : n.paths) {
    auto r = recent.find(p.name);
    paths.push_back({{"path", p.name},
                     {"bytes_total", p.bytes},
                     {"moves_total", p.moves},
                     {"recent_bytes_per_second", r == recent.end() ? Json() : Json(r->second)},
                     {"estimate_bytes_per_second", p.bytes_per_second},
                     {"probed_bytes_per_second", p.probed_bytes_per_second}});
  }
  Json sessions = Json::array();
  for (const SessionSummary& s : n.session_list) {
    sessions.push_back({{"id", s.id},
                        {"client_name", s.client_name},
                        {"job", s.job.empty() ? Json() : Json(s.job)},
                        {"moved_bytes", s.moved_bytes},
                        {"uid", s.uid},
                        {"pid", s.pid},
                        {"opened_unix_seconds", absl::ToUnixSeconds(s.opened)},
                        {"chunks", s.chunks},
                        {"bytes", s.bytes},
                        {"pinned_chunks", s.pinned_chunks}});
  }
  Json tenants = Json::array();
  for (const TenantStatus& t : n.tenants) {
    Json uses = Json::array();
    for (const TenantStatus::TierUse& u : t.tiers) {
      uses.push_back({{"tier", TierName(u.tier)},
                      {"used_bytes", u.used_bytes},
                      {"quota_bytes", u.quota_bytes ? Json(u.quota_bytes) : Json()}});
    }
    Json refusals = Json::object();
    for (const auto& [limit, count] : t.refusals) refusals[limit] = count;
    tenants.push_back({{"uid", t.uid},
                       {"user", t.user.empty() ? Json() : Json(t.user)},
                       {"sessions", t.sessions},
                       {"chunks", t.chunks},
                       {"schedule_accesses", t.schedule_accesses},
                       {"tiers", std::move(uses)},
                       {"refusals", std::move(refusals)}});
  }
  const LimitsStatus& l = n.limits;
  Json fallbacks = Json::object();
  for (const auto& [what, why] : n.fallbacks) fallbacks[what] = why;
  PrintJson({{"hostname", n.hostname},
             {"version", n.version},
             {"uptime_seconds", n.uptime_seconds},
             {"sessions", n.sessions},
             {"chunks", n.chunks},
             {"device", std::move(device)},
             {"sample_seconds", absl::ToDoubleSeconds(sample)},
             {"tiers", std::move(tiers)},
             {"paths", std::move(paths)},
             {"session_list", std::move(sessions)},
             {"tenants", std::move(tenants)},
             {"bases", BasesJson(bases)},
             {"limits",
              {{"connections_per_uid", l.connections_per_uid},
               {"sessions_per_uid", l.sessions_per_uid},
               {"chunks_per_session", l.chunks_per_session},
               {"chunks_per_uid", l.chunks_per_uid},
               {"schedule_accesses_per_session", l.schedule_accesses_per_session},
               {"schedule_accesses_per_uid", l.schedule_accesses_per_uid},
               {"trace_steps", l.trace_steps}}},
             {"fallbacks", std::move(fallbacks)}});
}

int Tierctl::Unhealthy(const std::string& why) const {
  if (json_) {
    PrintJson({{"healthy", false}, {"reason", why}});
  } else {
    std::printf("unhealthy: %s\n", why.c_str());
  }
  return 1;
}

int Tierctl::Health() {
  absl::StatusOr<NodeInfo> info = client_->GetNodeInfo();
  if (!info.ok()) return Unhealthy(info.status().ToString());
  const TierStatus* host = info->tier(Tier::kHost);
  if (host == nullptr || !host->configured || host->capacity_bytes == 0) {
    return Unhealthy("the host tier is not up");
  }
  if (json_) {
    PrintJson({{"healthy", true},
               {"version", info->version},
               {"uptime_seconds", info->uptime_seconds},
               {"sessions", info->sessions}});
  } else {
    std::printf("ok: tierd %s, up %s, %u session(s)\n", info->version.c_str(),
                absl::FormatDuration(absl::Seconds(info->uptime_seconds)).c_str(), info->sessions);
  }
  return 0;
}

}  // namespace tierd
