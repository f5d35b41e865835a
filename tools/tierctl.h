// tierctl's commands as one class over a client of the running daemon: tierctl.cc parses the
// command line and runs one (Run), tierctl_status.cc answers what the node is doing (status,
// health, bases), tierctl_moves.cc what moves or measures chunks (chunks, drain, evict, bench,
// doctor).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "tierd/client.hpp"

namespace tierd {

extern const char kUsage[];

struct Args {
  std::string command;
  std::map<std::string, std::string> flags;  // --key=value; a bare --key is "true"
  std::vector<std::string> positional;
};

Args Parse(int argc, char** argv);

using Json = nlohmann::ordered_json;  // keys in the order written, as scripts have seen them

// Prints one JSON document on a line. A string that is not UTF-8 (a path, a hostname) has its bad
// bytes replaced rather than ending tierctl with an exception.
void PrintJson(const Json& j);
std::string Rate(double bytes_per_second);
// Says why on stderr (and who may ask, for a refusal); returns tierctl's exit status 1.
int Fail(const absl::Status& s, std::string_view doing);

class Tierctl {
 public:
  explicit Tierctl(Args args) : args_(std::move(args)), json_(args_.flags.count("json") > 0) {}

  // Runs the command the arguments name; returns the exit status.
  int Run();

 private:
  std::string Flag(const std::string& key, std::string fallback = "") const;
  int Usage(const std::string& why) const;

  // tierctl_status.cc
  int Status();
  static Json BasesJson(const std::vector<BaseStatus>& bases);
  static void PrintBases(const std::vector<BaseStatus>& bases);
  // bases: the shared bases this user may open (an operator: every one); `pin NAME` keeps one
  // without holders, `unpin NAME` lets it go with its last holder.
  int Bases();
  void PrintStatus(const NodeInfo& n, const std::map<std::string, double>& recent,
                   absl::Duration sample) const;
  void PrintStatusJson(const NodeInfo& n, const std::map<std::string, double>& recent,
                       absl::Duration sample, const std::vector<BaseStatus>& bases) const;
  int Unhealthy(const std::string& why) const;
  // Healthy: the daemon answers and its host tier (which every move passes through) is up.
  int Health();

  // tierctl_moves.cc
  int Chunks();
  // drain and evict: start the moves, then show progress until they settle.
  int Drain();
  // Moves chunks of this session over each path the daemon has, one request per chunk with all
  // of them in flight, as training issues them: host to NVMe and back, host to the device and
  // back. Each path's bandwidth is shown beside what the daemon's start-up probe measured.
  int Bench();
  int Doctor();
  static void ShowProgress(uint64_t done, uint64_t total);

  Args args_;
  bool json_;
  std::unique_ptr<Client> client_;
};

}  // namespace tierd
