// Built against an installed tierd through find_package(tierd): the C++ API and the C ABI link,
// and a connection to a directory with no daemon fails with a clear UNAVAILABLE.
#include <cstdio>

#include "tierd/client.h"
#include "tierd/client.hpp"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto client = tierd::Client::Connect({.socket_dir = argv[1], .client_name = "consumer"});
  if (client.ok() || !absl::IsUnavailable(client.status())) return 1;
  std::printf("abi %d; %s\n", tierd_abi_version(), client.status().ToString().c_str());
  return 0;
}
