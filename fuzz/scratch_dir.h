// A fuzz target's scratch directory, removed when the run ends (libFuzzer exits through exit()).
#ifndef TIERD_FUZZ_SCRATCH_DIR_H_
#define TIERD_FUZZ_SCRATCH_DIR_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace tierd {

// Makes `<parent>/tierd-fuzz-<name>-XXXXXX` (one per process: call it once); aborts if it cannot.
inline std::string FuzzScratchDir(const std::string& parent, const std::string& name) {
  static std::string* path = nullptr;
  if (path != nullptr) abort();
  std::string dir = parent + "/tierd-fuzz-" + name + "-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) abort();
  path = new std::string(dir);
  std::atexit([] {
    std::error_code ec;
    std::filesystem::remove_all(*path, ec);
  });
  return dir;
}

}  // namespace tierd

#endif  // TIERD_FUZZ_SCRATCH_DIR_H_
