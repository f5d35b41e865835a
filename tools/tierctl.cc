// tierctl: what an operator asks a running tierd. Human output by default, --json for scripts.
//
//   tierctl [--socket_dir=DIR] [--json] status [--sample=1s]
//   tierctl [--socket_dir=DIR] [--json] health
//   tierctl [--socket_dir=DIR] [--json] chunks [--tier=T] [--name=PREFIX] [--state=S]
//                                              [--session=ID] [--pinned]
//   tierctl [--socket_dir=DIR] [--json] bases [pin NAME | unpin NAME]
//   tierctl [--socket_dir=DIR] [--json] drain --tier=device|host [--timeout=10m]
//   tierctl [--socket_dir=DIR] [--json] evict --tier=device|host ID...
//   tierctl [--socket_dir=DIR] [--json] bench [--size=1GiB] [--chunk=16MiB]
//
// Exit status: 0 done (healthy), 1 the daemon said no or is unhealthy, 2 bad usage.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/sizes.h"
#include "nlohmann/json.hpp"
#include "tierd/client.hpp"
#include "tools/doctor.h"

namespace tierd {
namespace {

constexpr const char kUsage[] =
    "usage: tierctl [--socket_dir=DIR] [--json] COMMAND [options]\n"
    "  status [--sample=1s]       tiers, devices, sessions and recent bandwidth\n"
    "  health                     exit 0 when the daemon answers and its tiers are up\n"
    "  chunks [--tier=T] [--name=PREFIX] [--state=ready|moving] [--session=ID] [--pinned]\n"
    "                             every chunk on the node (root or the daemon's user)\n"
    "  bases [pin NAME | unpin NAME]\n"
    "                             shared bases: holders and bytes; keep one without holders\n"
    "  drain --tier=device|host [--timeout=10m]\n"
    "                             move every chunk out of a tier before maintenance\n"
    "  evict --tier=device|host ID...\n"
    "                             move the chunks named out of a tier\n"
    "  bench [--size=1GiB] [--chunk=16MiB]\n"
    "                             each path's bandwidth through this daemon, beside its probe\n"
    "  doctor [--regions=PATH,...] [--host_capacity=SIZE]\n"
    "                             what the daemon and clients need on this machine, each ok,\n"
    "                             warn, fail or skip with the fix (read-only; no daemon needed)\n"
    "Socket directory: --socket_dir, else $TIERD_SOCKET_DIR, else /run/tierd.\n";

struct Args {
  std::string command;
  std::map<std::string, std::string> flags;  // --key=value; a bare --key is "true"
  std::vector<std::string> positional;
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (absl::StartsWith(arg, "--")) {
      const size_t eq = arg.find('=');
      a.flags[arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2)] =
          eq == std::string::npos ? "true" : arg.substr(eq + 1);
    } else if (a.command.empty()) {
      a.command = arg;
    } else {
      a.positional.push_back(arg);
    }
  }
  return a;
}

using Json = nlohmann::ordered_json;  // keys in the order written, as scripts have seen them

// Prints one JSON document on a line. A string that is not UTF-8 (a path, a hostname) has its bad
// bytes replaced rather than ending tierctl with an exception.
void PrintJson(const Json& j) {
  std::printf("%s\n", j.dump(-1, ' ', false, Json::error_handler_t::replace).c_str());
}

std::string Rate(double bytes_per_second) {
  return FormatSize(static_cast<uint64_t>(std::max(0.0, bytes_per_second))) + "/s";
}

int Fail(const absl::Status& s, std::string_view doing) {
  std::fprintf(stderr, "tierctl: %s: %s\n", std::string(doing).c_str(), s.ToString().c_str());
  if (absl::IsPermissionDenied(s)) {
    std::fprintf(stderr, "tierctl: run it as root or as the daemon's user\n");
  }
  return 1;
}

class Tierctl {
 public:
  explicit Tierctl(Args args) : args_(std::move(args)), json_(args_.flags.count("json") > 0) {}

  int Run() {
    static const std::map<std::string, std::vector<std::string>> kFlags = {
        {"status", {"sample"}},
        {"health", {}},
        {"chunks", {"tier", "name", "state", "session", "pinned"}},
        {"bases", {}},
        {"drain", {"tier", "timeout"}},
        {"evict", {"tier"}},
        {"bench", {"size", "chunk"}},
        {"doctor", {"regions", "host_capacity", "probe", "arg"}}};
    auto known = kFlags.find(args_.command);
    if (known == kFlags.end()) return Usage("unknown command '" + args_.command + "'");
    for (const auto& [key, value] : args_.flags) {
      if (key == "json" || key == "socket_dir") continue;
      if (std::find(known->second.begin(), known->second.end(), key) == known->second.end()) {
        return Usage(absl::StrCat("'", args_.command, "' takes no --", key));
      }
    }
    if (args_.command != "evict" && args_.command != "bases" && !args_.positional.empty()) {
      return Usage(
          absl::StrCat("'", args_.command, "' takes no argument '", args_.positional.front(), "'"));
    }
    if (args_.command == "doctor") return Doctor();
    auto client = Client::Connect({.socket_dir = Flag("socket_dir"), .client_name = "tierctl"});
    if (!client.ok()) {
      if (args_.command == "health") return Unhealthy(client.status().ToString());
      return Fail(client.status(), "connecting to tierd");
    }
    client_ = std::move(*client);
    if (args_.command == "status") return Status();
    if (args_.command == "health") return Health();
    if (args_.command == "chunks") return Chunks();
    if (args_.command == "bases") return Bases();
    if (args_.command == "bench") return Bench();
    return Drain();
  }

 private:
  std::string Flag(const std::string& key, std::string fallback = "") const {
    auto it = args_.flags.find(key);
    return it == args_.flags.end() ? fallback : it->second;
  }
  int Usage(const std::string& why) const {
    std::fprintf(stderr, "tierctl: %s\n%s", why.c_str(), kUsage);
    return 2;
  }

  int Status() {
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

  static Json BasesJson(const std::vector<BaseStatus>& bases) {
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

  static void PrintBases(const std::vector<BaseStatus>& bases) {
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

  // bases: the shared bases this user may open (an operator: every one); `pin NAME` keeps one
  // without holders, `unpin NAME` lets it go with its last holder.
  int Bases() {
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

  void PrintStatus(const NodeInfo& n, const std::map<std::string, double>& recent,
                   absl::Duration sample) const {
    std::printf("tierd %s on %s, up %s, %u session(s), %llu chunk(s)\n", n.version.c_str(),
                n.hostname.c_str(), absl::FormatDuration(absl::Seconds(n.uptime_seconds)).c_str(),
                n.sessions, static_cast<unsigned long long>(n.chunks));
    std::printf("\n%-7s %12s %12s %6s %14s  %s\n", "TIER", "USED", "CAPACITY", "USE",
                "LARGEST FREE", "DETAIL");
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
                  r == recent.end() ? "-" : Rate(r->second).c_str(),
                  Rate(p.bytes_per_second).c_str(),
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

  void PrintStatusJson(const NodeInfo& n, const std::map<std::string, double>& recent,
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

  int Unhealthy(const std::string& why) const {
    if (json_) {
      PrintJson({{"healthy", false}, {"reason", why}});
    } else {
      std::printf("unhealthy: %s\n", why.c_str());
    }
    return 1;
  }

  // Healthy: the daemon answers and its host tier (which every move passes through) is up.
  int Health() {
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
                  absl::FormatDuration(absl::Seconds(info->uptime_seconds)).c_str(),
                  info->sessions);
    }
    return 0;
  }

  int Chunks() {
    std::optional<Tier> tier;
    if (!Flag("tier").empty() && !(tier = ParseTier(Flag("tier")))) {
      return Usage("--tier is device, host or nvme");
    }
    const std::string state = Flag("state");
    if (!state.empty() && state != "ready" && state != "moving") {
      return Usage("--state is ready or moving");
    }
    uint64_t session = 0;
    if (!Flag("session").empty() && !absl::SimpleAtoi(Flag("session"), &session)) {
      return Usage("--session takes a session id");
    }
    const std::string prefix = Flag("name");
    const bool pinned = Flag("pinned") == "true";
    absl::StatusOr<std::vector<ChunkInfo>> all = client_->ListChunks(/*all_sessions=*/true);
    if (!all.ok()) return Fail(all.status(), "ListChunks");
    std::vector<const ChunkInfo*> shown;
    for (const ChunkInfo& c : *all) {
      if (tier && std::find(c.resident.begin(), c.resident.end(), *tier) == c.resident.end()) {
        continue;
      }
      if (!state.empty() && c.moving != (state == "moving")) continue;
      if (session != 0 && c.owner_session != session) continue;
      if (!prefix.empty() && !absl::StartsWith(c.name, prefix)) continue;
      if (pinned && c.pins == 0) continue;
      shown.push_back(&c);
    }
    auto tiers = [](const std::vector<Tier>& ts) {
      std::vector<std::string> names;
      for (Tier t : ts) names.push_back(TierName(t));
      return names;
    };
    if (json_) {
      Json rows = Json::array();
      for (const ChunkInfo* c : shown) {
        rows.push_back({{"id", c->id},
                        {"size_bytes", c->size},
                        {"name", c->name},
                        {"persistent", c->persistent},
                        {"home", TierName(c->home)},
                        {"resident", tiers(c->resident)},
                        {"dirty", tiers(c->dirty)},
                        {"state", c->moving ? "moving" : "ready"},
                        {"pins", c->pins},
                        {"owner_session", c->owner_session},
                        {"lost", c->lost},
                        {"base", c->base.empty() ? Json() : Json(c->base)}});
      }
      PrintJson(rows);
      return 0;
    }
    std::printf("%-10s %12s %-6s %-18s %-7s %5s %8s  %s\n", "ID", "SIZE", "HOME", "RESIDENT",
                "STATE", "PINS", "SESSION", "NAME");
    uint64_t bytes = 0;
    for (const ChunkInfo* c : shown) {
      bytes += c->size;
      std::printf("%-10llu %12s %-6s %-18s %-7s %5u %8s  %s\n",
                  static_cast<unsigned long long>(c->id), FormatSize(c->size).c_str(),
                  TierName(c->home), absl::StrJoin(tiers(c->resident), ",").c_str(),
                  c->lost     ? "LOST"
                  : c->moving ? "moving"
                              : "ready",
                  c->pins, c->owner_session ? absl::StrCat(c->owner_session).c_str() : "-",
                  c->base.empty() ? c->name.c_str() : absl::StrCat("base ", c->base).c_str());
    }
    std::printf("%zu of %zu chunk(s), %s\n", shown.size(), all->size(), FormatSize(bytes).c_str());
    return 0;
  }

  // drain and evict: start the moves, then show progress until they settle.
  int Drain() {
    const std::optional<Tier> tier = ParseTier(Flag("tier"));
    if (!tier || *tier == Tier::kNvme) return Usage("--tier is device or host");
    std::vector<ChunkId> ids;
    if (args_.command == "evict") {
      if (args_.positional.empty()) return Usage("evict takes the ids of the chunks to move");
      for (const std::string& s : args_.positional) {
        ChunkId id;
        if (!absl::SimpleAtoi(s, &id)) return Usage("'" + s + "' is not a chunk id");
        ids.push_back(id);
      }
    }
    absl::Duration timeout;
    if (!absl::ParseDuration(Flag("timeout", "10m"), &timeout) || timeout <= absl::ZeroDuration()) {
      return Usage("--timeout takes a duration such as 10m");
    }
    absl::StatusOr<NodeInfo> before = client_->GetNodeInfo();
    if (!before.ok()) return Fail(before.status(), "GetNodeInfo");
    const TierStatus* t0 = before->tier(*tier);
    if (t0 == nullptr || !t0->configured) {
      std::fprintf(stderr, "tierctl: the %s tier is not configured\n", TierName(*tier));
      return 1;
    }
    const uint64_t used0 = t0->used_bytes;
    absl::StatusOr<DrainStarted> started = client_->Drain(*tier, ids);
    if (!started.ok()) return Fail(started.status(), args_.command);
    const bool bar = !json_ && isatty(STDOUT_FILENO);
    const absl::Time start = absl::Now(), give_up = start + timeout;
    absl::Status done;
    for (;;) {
      done = client_->Wait(started->done, absl::Milliseconds(200));
      if (!absl::IsDeadlineExceeded(done) || absl::Now() >= give_up) break;
      if (!bar) continue;
      absl::StatusOr<NodeInfo> now = client_->GetNodeInfo();
      if (!now.ok()) continue;
      const TierStatus* t = now->tier(*tier);
      const uint64_t freed = used0 > t->used_bytes ? used0 - t->used_bytes : 0;
      ShowProgress(std::min<uint64_t>(freed, started->bytes), started->bytes);
    }
    if (bar) {
      ShowProgress(started->bytes, started->bytes);
      std::printf("\n");
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    absl::StatusOr<NodeInfo> after = client_->GetNodeInfo();
    const uint64_t left = after.ok() ? after->tier(*tier)->used_bytes : 0;
    if (json_) {
      PrintJson({{"tier", TierName(*tier)},
                 {"ok", done.ok()},
                 {"error", done.ok() ? Json() : Json(done.ToString())},
                 {"chunks", started->chunks},
                 {"bytes", started->bytes},
                 {"pinned_chunks", started->pinned_chunks},
                 {"seconds", seconds},
                 {"tier_used_bytes", left}});
    } else {
      std::printf(
          "%s: moved %llu chunk(s), %s, out of the %s tier in %.2f s; %llu acquired "
          "chunk(s) left there; the tier now holds %s\n",
          done.ok() ? "done" : "failed", static_cast<unsigned long long>(started->chunks),
          FormatSize(started->bytes).c_str(), TierName(*tier), seconds,
          static_cast<unsigned long long>(started->pinned_chunks), FormatSize(left).c_str());
    }
    if (absl::IsDeadlineExceeded(done)) {
      std::fprintf(stderr, "tierctl: the moves did not settle within %s\n",
                   absl::FormatDuration(timeout).c_str());
      return 1;
    }
    if (!done.ok()) return Fail(done, args_.command);
    return started->pinned_chunks > 0 && args_.command == "evict" ? 1 : 0;
  }

  // Moves chunks of this session over each path the daemon has, one request per chunk with all
  // of them in flight, as training issues them: host to NVMe and back, host to the device and
  // back. Each path's bandwidth is shown beside what the daemon's start-up probe measured.
  int Bench() {
    uint64_t size, chunk;
    if (absl::StatusOr<uint64_t> v = ParseSize(Flag("size", "1GiB")); v.ok() && *v > 0) {
      size = *v;
    } else {
      return Usage("--size takes a size such as 1GiB");
    }
    if (absl::StatusOr<uint64_t> v = ParseSize(Flag("chunk", "16MiB")); v.ok() && *v > 0) {
      chunk = *v;
    } else {
      return Usage("--chunk takes a size such as 16MiB");
    }
    if (chunk > size) return Usage("--chunk is larger than --size");
    absl::StatusOr<NodeInfo> info = client_->GetNodeInfo();
    if (!info.ok()) return Fail(info.status(), "GetNodeInfo");
    auto configured = [&](Tier t) {
      const TierStatus* s = info->tier(t);
      return s != nullptr && s->configured;
    };
    std::vector<ChunkSpec> specs(size / chunk, ChunkSpec{.size = chunk, .home = Tier::kHost});
    absl::StatusOr<std::vector<ChunkId>> ids = client_->AllocateIds(specs);
    if (!ids.ok()) {
      Fail(ids.status(), "Allocate");
      const TierStatus* host = info->tier(Tier::kHost);
      std::fprintf(
          stderr, "tierctl: the bench needs %s of the host tier; %s is free: try --size=%s\n",
          FormatSize(size).c_str(), FormatSize(host ? host->free_bytes : 0).c_str(),
          absl::StrCat((host ? host->free_bytes / chunk * chunk : 0) >> 20, "MiB").c_str());
      return 1;
    }
    struct Result {
      std::string path;
      uint64_t bytes = 0;
      double seconds = 0;
      double probed = 0;  // bytes per second, 0: not probed
    };
    std::vector<Result> results;
    absl::Status error;
    // One path: `request` issues one chunk's move; the chunks are waited for in order.
    auto measure = [&](const std::string& path, std::span<const ChunkId> chunks,
                       auto request) -> bool {
      const bool bar = !json_ && isatty(STDOUT_FILENO);
      std::vector<CompletionToken> tokens;
      const absl::Time start = absl::Now();
      for (const ChunkId& id : chunks) {
        absl::StatusOr<CompletionToken> t = request(std::span<const ChunkId>(&id, 1));
        if (!t.ok()) {
          error = t.status();
          return false;
        }
        tokens.push_back(*t);
      }
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (absl::Status s = client_->Wait(tokens[i]); !s.ok()) {
          error = s;
          return false;
        }
        if (bar) {
          std::printf("\r%-15s ", path.c_str());
          ShowProgress((i + 1) * chunk, chunks.size() * chunk);
        }
      }
      Result r{path, chunks.size() * chunk, absl::ToDoubleSeconds(absl::Now() - start), 0};
      if (const PathStatus* p = info->path(path)) r.probed = p->probed_bytes_per_second;
      if (bar) std::printf("\r\033[K");
      if (!json_) {
        std::printf("%-15s %12s in %7.3f s: %12s", path.c_str(), FormatSize(r.bytes).c_str(),
                    r.seconds, Rate(r.bytes / r.seconds).c_str());
        if (r.probed > 0) {
          std::printf("  (%.2f x the start-up probe's %s)", r.bytes / r.seconds / r.probed,
                      Rate(r.probed).c_str());
        }
        std::printf("\n");
      }
      results.push_back(std::move(r));
      return true;
    };
    bool ok = true;
    if (absl::StatusOr<Acquired> a = client_->AcquireIds(*ids, Tier::kHost, AccessMode::kOverwrite);
        a.ok() && client_->Wait(a->ready).ok()) {
      for (const AcquiredChunk& c : a->chunks) std::memset(c.data, 0x5a, c.size);
      error = client_->Release(*ids);
    } else {
      error = a.ok() ? absl::InternalError("the chunks did not arrive") : a.status();
    }
    ok = error.ok();
    if (ok && configured(Tier::kNvme)) {
      ok = measure("host_to_nvme", *ids,
                   [&](std::span<const ChunkId> c) { return client_->EvictIds(c, Tier::kNvme); }) &&
           measure("nvme_to_host", *ids, [&](std::span<const ChunkId> c) {
             return client_->PrefetchIds(c, Tier::kHost);
           });
    }
    if (ok && configured(Tier::kDevice)) {
      // As many chunks as the device tier has room for.
      const TierStatus* device = info->tier(Tier::kDevice);
      const size_t fit = std::min<size_t>(ids->size(), device->free_bytes / chunk);
      std::span<const ChunkId> some(ids->data(), fit);
      if (fit > 0) {
        ok = measure("host_to_device", some, [&](std::span<const ChunkId> c) {
          return client_->PrefetchIds(c, Tier::kDevice);
        });
      }
      if (ok && fit > 0) {
        // Written on the device, so that evicting them copies them back.
        absl::StatusOr<Acquired> a = client_->AcquireIds(some, Tier::kDevice, AccessMode::kWrite);
        error = a.ok() ? client_->Wait(a->ready) : a.status();
        if (a.ok()) (void)client_->Release(some);
        ok = error.ok() && measure("device_to_host", some, [&](std::span<const ChunkId> c) {
               return client_->EvictIds(c, Tier::kHost);
             });
      }
    }
    const absl::Status freed = client_->Free(*ids);
    if (!ok) return Fail(error.ok() ? absl::InternalError("a move failed") : error, "bench");
    if (!freed.ok()) return Fail(freed, "Free");
    if (json_) {
      Json paths = Json::array();
      for (const Result& r : results) {
        paths.push_back({{"path", r.path},
                         {"bytes", r.bytes},
                         {"seconds", r.seconds},
                         {"bytes_per_second", r.bytes / r.seconds},
                         {"probed_bytes_per_second", r.probed}});
      }
      PrintJson({{"chunk_bytes", chunk}, {"paths", std::move(paths)}});
    }
    return 0;
  }

  int Doctor() {
    if (args_.flags.count("probe")) return doctor::RunProbeChild(Flag("probe"), Flag("arg"));
    doctor::Options o;
    o.socket_dir = Flag("socket_dir");
    o.self = std::filesystem::read_symlink("/proc/self/exe").string();
    if (!Flag("regions").empty())
      o.regions = absl::StrSplit(Flag("regions"), ',', absl::SkipEmpty());
    if (!Flag("host_capacity").empty()) {
      absl::StatusOr<uint64_t> size = ParseSize(Flag("host_capacity"));
      if (!size.ok()) return Usage(absl::StrCat("--host_capacity: ", size.status().message()));
      o.host_capacity = *size;
    }
    const std::vector<doctor::Check> checks = doctor::Run(o);
    int counts[4] = {};
    for (const doctor::Check& c : checks) ++counts[static_cast<int>(c.result)];
    if (json_) {
      Json rows = Json::array();
      for (const doctor::Check& c : checks) {
        rows.push_back({{"name", c.name},
                        {"result", doctor::ResultName(c.result)},
                        {"detail", c.detail},
                        {"fix", c.fix}});
      }
      PrintJson({{"checks", std::move(rows)},
                 {"ok", counts[0]},
                 {"warn", counts[1]},
                 {"fail", counts[2]},
                 {"skip", counts[3]}});
    } else {
      for (const doctor::Check& c : checks) {
        std::printf("%-4s  %-20s %s\n", doctor::ResultName(c.result), c.name.c_str(),
                    c.detail.c_str());
        if (c.result != doctor::Result::kOk && !c.fix.empty()) {
          std::printf("      %-20s fix: %s\n", "", c.fix.c_str());
        }
      }
      std::printf("%d ok, %d warn, %d fail, %d skip\n", counts[0], counts[1], counts[2], counts[3]);
    }
    return counts[static_cast<int>(doctor::Result::kFail)] > 0 ? 1 : 0;
  }

  static void ShowProgress(uint64_t done, uint64_t total) {
    constexpr int kWidth = 40;
    const double f = total == 0 ? 1.0 : static_cast<double>(done) / total;
    const int filled = static_cast<int>(f * kWidth);
    std::printf("\r[%s%s] %5.1f%% %s of %s", std::string(filled, '#').c_str(),
                std::string(kWidth - filled, ' ').c_str(), 100 * f, FormatSize(done).c_str(),
                FormatSize(total).c_str());
    std::fflush(stdout);
  }

  Args args_;
  bool json_;
  std::unique_ptr<Client> client_;
};

}  // namespace
}  // namespace tierd

int main(int argc, char** argv) {
  tierd::Args args = tierd::Parse(argc, argv);
  if (args.command == "help" || args.flags.count("help")) {
    std::fputs(tierd::kUsage, stdout);
    return 0;
  }
  if (args.command.empty()) {
    std::fputs(tierd::kUsage, stderr);
    return 2;
  }
  return tierd::Tierctl(std::move(args)).Run();
}
