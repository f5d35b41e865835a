// The vocabulary every layer above shares: chunk and session ids and the ways an acquisition uses
// a chunk. A leaf: nothing of the daemon below it.
#pragma once

#include <cstdint>

namespace tierd::daemon {

using ChunkId = uint64_t;
using SessionId = uint64_t;

// How an Acquire uses a chunk. kOverwrite writes every byte before reading any: the old contents
// are not fetched (the acquired bytes are undefined until written), only room is reserved.
enum class Access : uint8_t { kRead = 1, kWrite = 2, kOverwrite = 3 };

inline bool Writes(Access a) { return a != Access::kRead; }

}  // namespace tierd::daemon
