// The start-up bandwidth probe: before the daemon serves, it moves a few tens of MiB over each
// path — host to NVMe and back through the I/O engine, host to device and back through the
// device's copy engines — so that the planner's first plans use this node's figures instead of
// guesses. Moves measured later refine them (ChunkService::MoveDone).
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "daemon/tiers/hop.h"
#include "daemon/tiers/tier.h"

namespace tierd::daemon {

// Bytes per second per path (indexed by Path); 0 for a path not probed.
using PathBandwidth = PathArray<double>;

// Moves up to `bytes` over each path there is (a tier with hops both ways), through the hops the
// chunk service will use. Uses free space in each tier and gives it back; reads verify what the
// writes wrote. Fails (saying which path and why) when a move fails. A path without room for the
// probe (less than 4 MiB free in one of its tiers) is not probed.
absl::StatusOr<PathBandwidth> ProbePaths(const Tiers& tiers, uint64_t bytes);

}  // namespace tierd::daemon
