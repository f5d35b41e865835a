// The completion page protocol: the daemon's ring against the client's wait/poll.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "common/completion_page.h"
#include "daemon/chunks/completion_ring.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

// The client's view: a second mapping of the ring's memfd, as a client process has.
struct ClientView {
  explicit ClientView(int fd) {
    void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED);
    page = static_cast<CompletionPage*>(p);
  }
  ~ClientView() { munmap(page, kCompletionPageBytes); }
  CompletionPage* page;
};

TEST(CompletionTest, PageHeaderIdentifiesTheSession) {
  auto ring = CompletionRing::Create(42);
  ASSERT_TRUE(ring.ok());
  ClientView view((*ring)->fd());
  EXPECT_EQ(view.page->header.magic, kCompletionPageMagic);
  EXPECT_EQ(view.page->header.slot_count, kCompletionSlots);
  EXPECT_EQ(view.page->header.session_id, 42u);
}

TEST(CompletionTest, CompletedRequestIsReadyAndWaitReturnsItsStatus) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  SlotToken ok = *ring->PostCompleted(absl::OkStatus());
  SlotToken failed = *ring->PostCompleted(absl::DataLossError("bad checksum"));
  EXPECT_EQ(*PollCompletion(*view.page, ok), SlotState::kOk);
  EXPECT_TRUE(WaitCompletion(*view.page, ok, absl::ZeroDuration()).ok());
  absl::Status s = WaitCompletion(*view.page, failed, absl::ZeroDuration());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
}

TEST(CompletionTest, FailureMessagesTravelWithTheCodeUntilOverwritten) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  SlotToken first = *ring->PostCompleted(absl::DataLossError("chunk 7: checksum mismatch"));
  absl::Status s = WaitCompletion(*view.page, first, absl::ZeroDuration());
  EXPECT_TRUE(absl::IsDataLoss(s));
  EXPECT_EQ(s.message(), "chunk 7: checksum mismatch");
  // A failure whose record was overwritten by kErrorRecords later ones keeps its code.
  SlotToken old = *ring->PostCompleted(absl::InternalError("old"));
  for (uint32_t i = 0; i < kErrorRecords; ++i) {
    (void)ring->PostCompleted(absl::UnavailableError("newer"));
  }
  s = WaitCompletion(*view.page, old, absl::ZeroDuration());
  EXPECT_TRUE(absl::IsInternal(s));
  EXPECT_NE(s.message().find("overwritten"), std::string::npos) << s;
}

TEST(CompletionTest, PendingRequestTimesOutThenCompletesFromAnotherThread) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  SlotToken token = *ring->Post();
  EXPECT_EQ(*PollCompletion(*view.page, token), SlotState::kPending);
  EXPECT_TRUE(absl::IsDeadlineExceeded(WaitCompletion(*view.page, token, absl::Milliseconds(10))));
  std::thread completer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ring->Complete(token, absl::OkStatus());
  });
  EXPECT_TRUE(WaitCompletion(*view.page, token, absl::Seconds(10)).ok());
  completer.join();
}

TEST(CompletionTest, WaiterInAnotherProcessIsWokenThroughTheSharedPage) {
  auto ring = *CompletionRing::Create(1);
  SlotToken token = *ring->Post();
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ClientView view(ring->fd());
    absl::Status s = WaitCompletion(*view.page, token, absl::Seconds(20));
    _exit(s.ok() ? 0 : 1);
  }
  absl::SleepFor(absl::Milliseconds(100));  // let the child block in the futex
  ring->Complete(token, absl::OkStatus());
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(CompletionTest, SlotsAreReusedOnlyAfterTheClientAcknowledges) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  std::vector<SlotToken> tokens;
  for (uint32_t i = 0; i < kCompletionSlots; ++i)
    tokens.push_back(*ring->PostCompleted(absl::OkStatus()));
  absl::Status full = ring->Post().status();
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  // Acknowledging one token (by waiting on it) frees exactly its slot.
  ASSERT_TRUE(WaitCompletion(*view.page, tokens[5], absl::ZeroDuration()).ok());
  auto next = ring->Post();
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->slot, tokens[5].slot);
  EXPECT_EQ(next->sequence, tokens[5].sequence + 1);
  // The old token is now stale, and says so instead of reporting the new request.
  EXPECT_TRUE(absl::IsFailedPrecondition(PollCompletion(*view.page, tokens[5]).status()));
}

TEST(CompletionTest, ClientScribblingOnTheWordCannotMakeAPendingSlotReusable) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  SlotToken token = *ring->Post();
  view.page->slots[token.slot].word.store(SlotWord(token.sequence, SlotState::kOk));
  view.page->slots[token.slot].acked.store(token.sequence);
  // The daemon's own record says pending: the slot is not handed out again.
  for (uint32_t i = 0; i + 1 < kCompletionSlots; ++i) {
    auto t = ring->Post();
    ASSERT_TRUE(t.ok());
    ASSERT_NE(t->slot, token.slot);
  }
  EXPECT_EQ(ring->pending(), kCompletionSlots);
}

// The value GPU streams wait on (cyclic >=) is reached exactly when the request completes, success
// or failure, and stays reached when the slot moves on to later requests.
TEST(CompletionTest, DoneValueIsReachedOnCompletionAndStaysReachedAfterReuse) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  SlotToken token = *ring->Post();
  std::atomic<uint32_t>& word = view.page->slots[token.slot].word;
  EXPECT_FALSE(SlotReached(word.load(), SlotDoneValue(token.sequence)));
  ring->Complete(token, absl::OkStatus());
  EXPECT_TRUE(SlotReached(word.load(), SlotDoneValue(token.sequence)));
  // Acknowledged, the slot is reused; the next request's pending word still passes the old wait.
  view.page->slots[token.slot].acked.store(token.sequence);
  SlotToken next{};
  for (;;) {
    next = *ring->Post();
    if (next.slot == token.slot) break;
    ring->Complete(next, absl::OkStatus());
    view.page->slots[next.slot].acked.store(next.sequence);
  }
  EXPECT_GT(next.sequence, token.sequence);
  EXPECT_TRUE(SlotReached(word.load(), SlotDoneValue(token.sequence)));
  EXPECT_FALSE(SlotReached(word.load(), SlotDoneValue(next.sequence)));
  ring->Complete(next, absl::InternalError("failed"));
  EXPECT_TRUE(SlotReached(word.load(), SlotDoneValue(next.sequence)));
}

TEST(CompletionTest, DoneValueComparesAcrossTheSequenceWrap) {
  const uint32_t last = kMaxSlotSequence;
  EXPECT_FALSE(SlotReached(SlotWord(last, SlotState::kPending), SlotDoneValue(last)));
  EXPECT_TRUE(SlotReached(SlotWord(last, SlotState::kOk), SlotDoneValue(last)));
  EXPECT_TRUE(SlotReached(SlotWord(last, SlotState::kFailed), SlotDoneValue(last)));
  // After the wrap, sequence 1 comes after kMaxSlotSequence.
  EXPECT_TRUE(SlotReached(SlotWord(1, SlotState::kPending), SlotDoneValue(last)));
  EXPECT_FALSE(SlotReached(SlotWord(last, SlotState::kOk), SlotDoneValue(1)));
}

TEST(CompletionTest, InvalidTokensAreRejected) {
  auto ring = *CompletionRing::Create(1);
  ClientView view(ring->fd());
  EXPECT_TRUE(
      absl::IsInvalidArgument(PollCompletion(*view.page, SlotToken{kCompletionSlots, 1}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(PollCompletion(*view.page, SlotToken{0, 0}).status()));
}

}  // namespace
}  // namespace tierd::daemon
