#include "daemon/chunks/wait_list.h"

#include <gtest/gtest.h>

#include <memory>

#include "daemon/chunks/batch.h"

namespace tierd::daemon {
namespace {

// A batch counted once for its waiter, as the chunk service counts it.
std::shared_ptr<Batch> Counted() {
  auto b = std::make_shared<Batch>();
  b->Add();
  return b;
}

Waiter Fetch(std::shared_ptr<Batch> batch, SessionId session, TierKind tier) {
  return Waiter{.batch = std::move(batch), .session = session, .tier = tier};
}

Waiter Eviction(std::shared_ptr<Batch> batch, TierKind tier) {
  return Waiter{.batch = std::move(batch), .session = 1, .tier = tier, .evict_keep_source = false};
}

TEST(WaitListTest, AChunkIsAwaitedInATierByRequestsNotByEvictions) {
  WaitList list;
  list.Add(7, Eviction(Counted(), TierKind::kNvme));
  EXPECT_FALSE(list.Awaited(7, TierKind::kNvme));  // an eviction waits for a move, not a copy
  list.Add(7, Fetch(Counted(), 1, TierKind::kDevice));
  EXPECT_TRUE(list.Awaited(7, TierKind::kDevice));
  EXPECT_FALSE(list.Awaited(7, TierKind::kHost));
  EXPECT_FALSE(list.Awaited(8, TierKind::kDevice));
}

TEST(WaitListTest, FailingATierFailsItsRequestsAndKeepsTheRest) {
  WaitList list;
  auto device = Counted(), host = Counted(), evict = Counted();
  list.Add(7, Fetch(device, 1, TierKind::kDevice));
  list.Add(7, Fetch(host, 1, TierKind::kHost));
  list.Add(7, Eviction(evict, TierKind::kDevice));
  list.Fail(7, TierKind::kDevice, absl::ResourceExhaustedError("no room"));
  EXPECT_TRUE(absl::IsResourceExhausted(device->Status()));
  EXPECT_TRUE(host->Status().ok());
  EXPECT_TRUE(evict->Status().ok());
  std::vector<Waiter> left = list.TakeAll(7);
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].batch, host);  // in the order they came
  EXPECT_EQ(left[1].batch, evict);
  EXPECT_TRUE(list.TakeAll(7).empty());
}

TEST(WaitListTest, TakeLastUndoesTheLatestAdd) {
  WaitList list;
  auto first = Counted(), second = Counted();
  list.Add(3, Fetch(first, 1, TierKind::kHost));
  list.Add(3, Fetch(second, 2, TierKind::kHost));
  EXPECT_EQ(list.TakeLast(3).batch, second);
  EXPECT_EQ(list.TakeLast(3).batch, first);
  EXPECT_FALSE(list.Awaited(3, TierKind::kHost));
}

TEST(WaitListTest, AnEndedSessionsWaitersAreForgottenAndTheOthersFailedTogether) {
  WaitList list;
  auto mine = Counted(), theirs = Counted();
  list.Add(5, Fetch(mine, 1, TierKind::kHost));
  list.Add(5, Fetch(theirs, 2, TierKind::kHost));
  list.Forget(5, /*session=*/1);
  list.FailAll(5, absl::AbortedError("freed"));
  EXPECT_TRUE(mine->Status().ok());  // forgotten, not failed
  EXPECT_TRUE(absl::IsAborted(theirs->Status()));
  EXPECT_TRUE(list.TakeAll(5).empty());
}

}  // namespace
}  // namespace tierd::daemon
