#include "daemon/chunks/wait_list.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "daemon/chunks/batch.h"

namespace tierd::daemon {

void WaitList::Add(ChunkId id, Waiter waiter) { waiting_[id].push_back(std::move(waiter)); }

Waiter WaitList::TakeLast(ChunkId id) {
  auto it = waiting_.find(id);
  assert(it != waiting_.end() && !it->second.empty());
  Waiter last = std::move(it->second.back());
  it->second.pop_back();
  if (it->second.empty()) waiting_.erase(it);
  return last;
}

std::vector<Waiter> WaitList::TakeAll(ChunkId id) {
  auto it = waiting_.find(id);
  if (it == waiting_.end()) return {};
  std::vector<Waiter> all = std::move(it->second);
  waiting_.erase(it);
  return all;
}

bool WaitList::Awaited(ChunkId id, TierKind tier) const {
  auto it = waiting_.find(id);
  return it != waiting_.end() &&
         std::any_of(it->second.begin(), it->second.end(),
                     [&](const Waiter& w) { return w.tier == tier && !w.evict_keep_source; });
}

void WaitList::Fail(ChunkId id, TierKind tier, const absl::Status& status) {
  auto it = waiting_.find(id);
  if (it == waiting_.end()) return;
  std::vector<Waiter> failed;
  std::erase_if(it->second, [&](Waiter& w) {
    if (w.tier != tier || w.evict_keep_source) return false;
    failed.push_back(std::move(w));
    return true;
  });
  if (it->second.empty()) waiting_.erase(it);
  for (Waiter& w : failed) w.batch->Done(status);
}

void WaitList::FailAll(ChunkId id, const absl::Status& status) {
  for (Waiter& w : TakeAll(id)) w.batch->Done(status);
}

void WaitList::Forget(ChunkId id, SessionId session) {
  auto it = waiting_.find(id);
  if (it == waiting_.end()) return;
  std::erase_if(it->second, [&](const Waiter& w) { return w.session == session; });
  if (it->second.empty()) waiting_.erase(it);
}

}  // namespace tierd::daemon
