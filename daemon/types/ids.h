// The vocabulary every layer above shares: chunk and session ids and the ways an acquisition uses
// a chunk. A leaf: nothing of the daemon below it.
#pragma once

#include <cstdint>

namespace tierd::daemon {

using ChunkId = uint64_t;
using SessionId = uint64_t;
// A shared base (chunks/shared_bases.h), numbered from 1 and never reused while the daemon
// runs; 0: none.
using BaseId = uint32_t;

// Segments hold one owner's chunks (tiers/segment_pool.h). A user's owner is its uid; a shared
// base's chunks sit in segments of their own, owned by kFirstBaseOwner + its id, so that whoever
// may read the base maps nothing else. Sessions of uids from kFirstBaseOwner up are refused.
inline constexpr uint32_t kFirstBaseOwner = 0xF0000000u;
inline constexpr uint32_t kMaxBaseId = 0xFFFFFFFEu - kFirstBaseOwner;  // below kNoTenant
inline constexpr uint32_t SegmentOwnerOfBase(BaseId base) { return kFirstBaseOwner + base; }

// How an Acquire uses a chunk. kOverwrite writes every byte before reading any: the old contents
// are not fetched (the acquired bytes are undefined until written), only room is reserved.
enum class Access : uint8_t { kRead = 1, kWrite = 2, kOverwrite = 3 };

inline bool Writes(Access a) { return a != Access::kRead; }

}  // namespace tierd::daemon
