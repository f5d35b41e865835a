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
//   tierctl [--json] doctor [--regions=PATH,...] [--host_capacity=SIZE]
//
// The commands are one class (tierctl.h): this file parses the command line and runs one;
// tierctl_status.cc answers what the node is doing, tierctl_moves.cc moves or measures chunks.
//
// Exit status: 0 done (healthy), 1 the daemon said no or is unhealthy, 2 bad usage.

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/sizes.h"
#include "tools/tierctl.h"

namespace tierd {

const char kUsage[] =
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

int Tierctl::Run() {
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

std::string Tierctl::Flag(const std::string& key, std::string fallback) const {
  auto it = args_.flags.find(key);
  return it == args_.flags.end() ? fallback : it->second;
}

int Tierctl::Usage(const std::string& why) const {
  std::fprintf(stderr, "tierctl: %s\n%s", why.c_str(), kUsage);
  return 2;
}

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
