// What the files of ChunkService share and nothing outside daemon/chunks/ needs: the batch a
// request's moves complete, the wrapper that counts a tier's callbacks, and small helpers.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

// A batch of asynchronous moves sharing one completion token. Holds the session so that its
// completion page outlives the moves.
struct ChunkService::Batch {
  std::shared_ptr<const Session> session;
  SlotToken token;
  absl::Mutex mu;
  size_t remaining ABSL_GUARDED_BY(mu) = 1;  // the issuer's own reference, dropped last
  absl::Status status ABSL_GUARDED_BY(mu);
  // For the daemon's own batches (no session): called with the result instead.
  std::function<void(const absl::Status&)> on_done;

  void Add() {
    absl::MutexLock lock(&mu);
    ++remaining;
  }
  void Done(const absl::Status& s) {
    absl::Status result;
    {
      absl::MutexLock lock(&mu);
      if (status.ok() && !s.ok()) status = s;
      if (--remaining > 0) return;
      result = status;
    }
    if (session != nullptr) session->completions->Complete(token, result);
    if (on_done) on_done(result);
  }
  absl::Status Status() {
    absl::MutexLock lock(&mu);
    return status;
  }
};

template <typename F>
auto ChunkService::Tracked(F callback) {
  return [op = BeginTierOp(), callback = std::move(callback)](auto&&... args) mutable {
    callback(std::forward<decltype(args)>(args)...);
  };
}

// Tiers from fastest to slowest.
inline int Rank(TierKind tier) {
  switch (tier) {
    case TierKind::kDevice:
      return 2;
    case TierKind::kHost:
      return 1;
    case TierKind::kNvme:
      return 0;
  }
  return -1;
}

// A copy in `tier` is clean when a lower tier holds a valid copy too.
inline bool CleanIn(const ChunkMeta& c, TierKind tier) {
  if (!c.resident.contains(tier)) return false;
  for (TierKind lower : {TierKind::kHost, TierKind::kNvme}) {
    if (Rank(lower) < Rank(tier) && c.resident.contains(lower)) return true;
  }
  return false;
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
