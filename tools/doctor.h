// `tierctl doctor`: a read-only check of what the daemon and its clients depend on on this machine,
// each line ok / warn / fail / skip with what to do about it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierd::doctor {

enum class Result { kOk, kWarn, kFail, kSkip };

struct Check {
  std::string name;  // "io_uring", "cuda.stream_wait", ...
  Result result = Result::kOk;
  std::string detail;  // what was found
  std::string fix;     // what to do, when not ok
};

struct Options {
  std::string socket_dir;            // the daemon's; asked for its configuration when it answers
  std::vector<std::string> regions;  // NVMe region paths to check (else the daemon's)
  uint64_t host_capacity = 0;        // else the daemon's
  std::string self;                  // this program, re-run for the cross-process probes
};

std::vector<Check> Run(const Options& options);

// The child side of a cross-process probe (`tierctl doctor --probe=NAME ...`); returns the exit
// status and prints one line saying what happened.
int RunProbeChild(const std::string& probe, const std::string& argument);

const char* ResultName(Result r);

}  // namespace tierd::doctor
