#include "common/completion_page.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace tierd {

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout != absl::InfiniteDuration()) {
    ts = absl::ToTimespec(timeout);
    tsp = &ts;
  }
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, tsp, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void RecordError(CompletionPage& page, uint32_t index, SlotToken token, absl::string_view message) {
  ErrorRecord& r = page.errors[index % kErrorRecords];
  r.sequence.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  const size_t n = std::min(message.size(), sizeof(r.message) - 1);
  std::memcpy(r.message, message.data(), n);
  r.message[n] = '\0';
  r.slot.store(token.slot, std::memory_order_relaxed);
  r.sequence.store(token.sequence, std::memory_order_release);
}

std::string FindError(const CompletionPage& page, SlotToken token) {
  for (const ErrorRecord& r : page.errors) {
    if (r.sequence.load(std::memory_order_acquire) != token.sequence ||
        r.slot.load(std::memory_order_relaxed) != token.slot) {
      continue;
    }
    char copy[sizeof(r.message)];
    std::memcpy(copy, r.message, sizeof(copy));
    copy[sizeof(copy) - 1] = '\0';
    std::atomic_thread_fence(std::memory_order_acquire);
    if (r.sequence.load(std::memory_order_relaxed) != token.sequence) break;  // overwritten
    return copy;
  }
  return "";
}

namespace {

absl::Status CheckToken(SlotToken token) {
  if (token.slot >= kCompletionSlots || token.sequence == 0 || token.sequence > kMaxSlotSequence) {
    return absl::InvalidArgumentError(absl::StrCat("completion token (slot ", token.slot,
                                                   ", sequence ", token.sequence,
                                                   ") is not a token this daemon issued"));
  }
  return absl::OkStatus();
}

absl::Status Stale(SlotToken token, uint32_t word) {
  return absl::FailedPreconditionError(
      absl::StrCat("completion token (slot ", token.slot, ", sequence ", token.sequence,
                   ") is no longer current: the slot holds sequence ", SlotSequence(word),
                   "; a token can be waited on until it is acknowledged once"));
}

}  // namespace

absl::StatusOr<SlotState> PollCompletion(const CompletionPage& page, SlotToken token) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  uint32_t word = page.slots[token.slot].word.load(std::memory_order_acquire);
  if (SlotSequence(word) != token.sequence) return Stale(token, word);
  return SlotStateOf(word);
}

absl::Status WaitCompletion(CompletionPage& page, SlotToken token, absl::Duration timeout) {
  if (absl::Status s = CheckToken(token); !s.ok()) return s;
  CompletionSlot& slot = page.slots[token.slot];
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  for (;;) {
    uint32_t word = slot.word.load(std::memory_order_acquire);
    if (SlotSequence(word) != token.sequence) return Stale(token, word);
    SlotState state = SlotStateOf(word);
    if (state == SlotState::kOk || state == SlotState::kFailed) {
      absl::Status result = absl::OkStatus();
      if (state == SlotState::kFailed) {
        auto code = static_cast<absl::StatusCode>(slot.code.load(std::memory_order_relaxed));
        std::string message = FindError(page, token);
        if (message.empty()) {
          message = absl::StrCat("request in completion slot ", token.slot,
                                 " failed in the daemon (its message was overwritten by later "
                                 "failures; see the daemon's log)");
        }
        result = absl::Status(code, message);
      }
      slot.acked.store(token.sequence, std::memory_order_release);
      return result;
    }
    absl::Duration left =
        deadline == absl::InfiniteFuture() ? absl::InfiniteDuration() : deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "completion slot ", token.slot, " still pending after ", absl::FormatDuration(timeout)));
    }
    FutexWait(&slot.word, word, left);
  }
}

}  // namespace tierd
