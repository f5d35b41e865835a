// tierd-bench soak: what the run (bench/soak.cc) and its clients (bench/soak_client.cc) agree
// on. Each role runs in a process of its own (`tierd-bench soak-client --role=...`), so that
// killing it is a real client crash; it reports counters as lines "key value" on stdout and ends
// with one of these statuses, or 0.
#pragma once

#include <cstdint>

namespace tierd::bench {

// Exit status of a client whose daemon went away (a daemon kill): not a failure.
inline constexpr int kDaemonGone = 3;
// Exit status of a client that found wrong data or an escape; the details are on its stderr.
inline constexpr int kClientFound = 4;
// The user the hostile tenant runs as where the bench runs as root.
inline constexpr uint32_t kNobody = 65534;

}  // namespace tierd::bench
