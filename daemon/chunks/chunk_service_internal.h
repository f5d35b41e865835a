// What the files of ChunkService share and nothing outside daemon/chunks/ needs: small helpers.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/chunks/batch.h"
#include "daemon/chunks/chunk_service.h"

namespace tierd::daemon {

inline absl::Status Ended(const Session& session) {
  return absl::UnavailableError(absl::StrCat(session.Describe(), " has ended"));
}

inline absl::Status CheckBatch(size_t n, absl::string_view what) {
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": the batch is empty"));
  if (n > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a batch holds at most ", kMaxBatch, " chunks, not ", n));
  }
  return absl::OkStatus();
}

// The tiers a fetch of the chunk into `tier` needs space in: a fetch into the device stages
// through (or copies from) the chunk's host space. An overwrite fetches nothing: it needs room
// only where it lands.
inline std::vector<TierKind> RoomNeeded(const ChunkMeta& chunk, TierKind tier,
                                        Access access = Access::kRead) {
  std::vector<TierKind> needs;
  if (access == Access::kOverwrite && chunk.state == ChunkState::kReady) {
    if (!chunk.allocated.contains(tier)) needs.push_back(tier);
    return needs;
  }
  if (!chunk.allocated.contains(TierKind::kHost)) needs.push_back(TierKind::kHost);
  if (tier == TierKind::kDevice && !chunk.allocated.contains(TierKind::kDevice)) {
    needs.push_back(TierKind::kDevice);
  }
  return needs;
}

}  // namespace tierd::daemon
