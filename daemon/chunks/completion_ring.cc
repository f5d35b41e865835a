#include "daemon/chunks/completion_ring.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>

#include "absl/strings/str_cat.h"

namespace tierd::daemon {

absl::StatusOr<std::unique_ptr<CompletionRing>> CompletionRing::Create(uint64_t session_id) {
  UniqueFd fd(memfd_create("tierd-completions", MFD_CLOEXEC));
  if (!fd) return absl::ErrnoToStatus(errno, "memfd_create(tierd-completions)");
  if (ftruncate(fd.get(), kCompletionPageBytes) != 0) {
    return absl::ErrnoToStatus(errno, "ftruncate of a completion page");
  }
  void* base = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (base == MAP_FAILED) return absl::ErrnoToStatus(errno, "mmap of a completion page");
  auto* page = static_cast<CompletionPage*>(base);  // zero-filled by the kernel
  page->header.magic = kCompletionPageMagic;
  page->header.version = kCompletionPageVersion;
  page->header.slot_count = kCompletionSlots;
  page->header.session_id = session_id;
  return std::unique_ptr<CompletionRing>(new CompletionRing(std::move(fd), page));
}

CompletionRing::CompletionRing(UniqueFd fd, CompletionPage* page)
    : fd_(std::move(fd)),
      page_(page),
      sequence_(kCompletionSlots, 0),
      pending_(kCompletionSlots, false) {}

CompletionRing::~CompletionRing() { munmap(page_, kCompletionPageBytes); }

absl::StatusOr<SlotToken> CompletionRing::Post() {
  absl::MutexLock lock(&mu_);
  for (uint32_t probe = 0; probe < kCompletionSlots; ++probe) {
    const uint32_t slot = (next_ + probe) % kCompletionSlots;
    if (pending_[slot]) continue;
    const uint32_t seq = sequence_[slot];
    if (seq != 0 && page_->slots[slot].acked.load(std::memory_order_acquire) != seq) continue;
    const uint32_t next_seq = seq >= kMaxSlotSequence ? 1 : seq + 1;
    sequence_[slot] = next_seq;
    pending_[slot] = true;
    ++pending_count_;
    page_->slots[slot].word.store(SlotWord(next_seq, SlotState::kPending),
                                  std::memory_order_release);
    next_ = (slot + 1) % kCompletionSlots;
    return SlotToken{slot, next_seq};
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "all ", kCompletionSlots,
      " completion slots of this session are pending or not yet acknowledged: wait on (or drop) "
      "completion tokens before issuing more asynchronous requests"));
}

void CompletionRing::Complete(SlotToken token, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  assert(token.slot < kCompletionSlots && pending_[token.slot] &&
         sequence_[token.slot] == token.sequence);
  CompletionSlot& slot = page_->slots[token.slot];
  if (!status.ok()) RecordError(*page_, errors_++, token, status.message());
  slot.code.store(static_cast<int32_t>(status.code()), std::memory_order_relaxed);
  slot.word.store(SlotWord(token.sequence, status.ok() ? SlotState::kOk : SlotState::kFailed),
                  std::memory_order_release);
  pending_[token.slot] = false;
  --pending_count_;
  FutexWakeAll(&slot.word);
}

absl::StatusOr<SlotToken> CompletionRing::PostCompleted(const absl::Status& status) {
  absl::StatusOr<SlotToken> token = Post();
  if (!token.ok()) return token;
  // Nobody can be waiting on a token that has not been handed out yet: no wake-up needed.
  absl::MutexLock lock(&mu_);
  CompletionSlot& slot = page_->slots[token->slot];
  if (!status.ok()) RecordError(*page_, errors_++, *token, status.message());
  slot.code.store(static_cast<int32_t>(status.code()), std::memory_order_relaxed);
  slot.word.store(SlotWord(token->sequence, status.ok() ? SlotState::kOk : SlotState::kFailed),
                  std::memory_order_release);
  pending_[token->slot] = false;
  --pending_count_;
  return token;
}

size_t CompletionRing::pending() const {
  absl::MutexLock lock(&mu_);
  return pending_count_;
}

}  // namespace tierd::daemon
