// tierctl: what moves or measures chunks: chunks (the node's chunks listed), drain and evict,
// bench (each path's bandwidth through the daemon) and doctor (tierctl.h).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/sizes.h"
#include "tools/doctor.h"
#include "tools/tierctl.h"

namespace tierd {

int Tierctl::Chunks() {
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
  std::printf("%-10s %12s %-6s %-18s %-7s %5s %8s  %s\n", "ID", "SIZE", "HOME", "RESIDENT", "STATE",
              "PINS", "SESSION", "NAME");
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

int Tierctl::Drain() {
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

int Tierctl::Bench() {
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
    std::fprintf(stderr,
                 "tierctl: the bench needs %s of the host tier; %s is free: try --size=%s\n",
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
         measure("nvme_to_host", *ids,
                 [&](std::span<const ChunkId> c) { return client_->PrefetchIds(c, Tier::kHost); });
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

int Tierctl::Doctor() {
  if (args_.flags.count("probe")) return doctor::RunProbeChild(Flag("probe"), Flag("arg"));
  doctor::Options o;
  o.socket_dir = Flag("socket_dir");
  o.self = std::filesystem::read_symlink("/proc/self/exe").string();
  if (!Flag("regions").empty()) o.regions = absl::StrSplit(Flag("regions"), ',', absl::SkipEmpty());
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

void Tierctl::ShowProgress(uint64_t done, uint64_t total) {
  constexpr int kWidth = 40;
  const double f = total == 0 ? 1.0 : static_cast<double>(done) / total;
  const int filled = static_cast<int>(f * kWidth);
  std::printf("\r[%s%s] %5.1f%% %s of %s", std::string(filled, '#').c_str(),
              std::string(kWidth - filled, ' ').c_str(), 100 * f, FormatSize(done).c_str(),
              FormatSize(total).c_str());
  std::fflush(stdout);
}

}  // namespace tierd
