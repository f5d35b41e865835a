#include "client/read_ahead.h"

#include <algorithm>

namespace tierd::internal {

absl::Status ReadAheadWindow::Fill(
    size_t in_hand, absl::Duration pace,
    const std::function<std::vector<ChunkId>(size_t want)>& expected) {
  if (!streams_) return absl::OkStatus();
  if (absl::Status s = ReapWrites(); !s.ok()) return s;
  if (used(in_hand) >= slots_) return absl::OkStatus();
  const std::vector<ChunkId> ids = expected(ahead_.size() + slots_ - used(in_hand));
  for (size_t j = 0; j < ids.size(); ++j) {
    if (used(in_hand) >= slots_) break;
    if (Holds(ids[j])) continue;
    // Due when the worker reaches it at this pace (a priority unit is a millisecond; the daemon
    // caps any wait), so that write-backs, which free the budget, go before reads needed later.
    constexpr double kLatest = 1000;
    const int priority = -static_cast<int>(std::min(kLatest, absl::ToDoubleMilliseconds(pace * j)));
    absl::StatusOr<CompletionToken> t = client_->PrefetchIds({&ids[j], 1}, Tier::kHost, priority);
    if (!t.ok()) return t.status();
    ahead_.push_back({ids[j], *t});
  }
  return absl::OkStatus();
}

bool ReadAheadWindow::Holds(ChunkId id) const {
  return std::any_of(ahead_.begin(), ahead_.end(), [id](const Ahead& a) { return a.id == id; });
}

bool ReadAheadWindow::Take(ChunkId id) {
  for (auto it = ahead_.begin(); it != ahead_.end(); ++it) {
    if (it->id != id) continue;
    client_->Abandon(it->prefetch);
    ahead_.erase(it);
    return true;
  }
  return false;
}

absl::Status ReadAheadWindow::Drop() {
  while (!ahead_.empty()) {
    const ChunkId id = ahead_.back().id;
    Take(id);
    if (absl::Status s = WriteBack(id); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ReadAheadWindow::MakeRoom(size_t in_hand) {
  if (!streams_) return absl::ZeroDuration();
  if (absl::Status s = ReapWrites(); !s.ok()) return s;
  absl::Duration waited;
  while (used(in_hand) > slots_ && !(ahead_.empty() && writes_.empty())) {
    if (writes_.empty()) {
      const ChunkId id = ahead_.back().id;
      Take(id);
      if (absl::Status s = WriteBack(id); !s.ok()) return s;
    }
    absl::StatusOr<absl::Duration> w = WaitWrites(writes_.size() - 1);
    if (!w.ok()) return w.status();
    waited += *w;
  }
  return waited;
}

absl::Status ReadAheadWindow::WriteBack(ChunkId id) {
  if (!streams_) return absl::OkStatus();
  absl::StatusOr<CompletionToken> t = client_->EvictIds({&id, 1}, Tier::kNvme);
  if (!t.ok()) return t.status();
  writes_.push_back(*t);
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ReadAheadWindow::WaitWrites(size_t keep) {
  const absl::Time start = absl::Now();
  absl::Status first;
  while (writes_.size() > keep) {
    absl::Status s = client_->Wait(writes_.front());
    if (!s.ok() && first.ok()) first = s;
    writes_.pop_front();
  }
  if (!first.ok()) return first;
  return absl::Now() - start;
}

absl::Status ReadAheadWindow::ReapWrites() {
  absl::Status first;
  for (auto it = writes_.begin(); it != writes_.end();) {
    if (absl::IsUnavailable(client_->Poll(*it))) {  // pending
      ++it;
      continue;
    }
    absl::Status s = client_->Wait(*it);
    if (!s.ok() && first.ok()) first = s;
    it = writes_.erase(it);
  }
  return first;
}

}  // namespace tierd::internal
