// The daemon's side of a session's completion page (common/completion_page.h): hands out slots to
// asynchronous requests and completes them. The daemon keeps its own record of each slot's
// sequence and whether it is pending, and trusts nothing the client writes except the
// acknowledgement, which only decides when the client's own slot can be reused.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/completion_page.h"
#include "common/unique_fd.h"

namespace tierd::daemon {

class CompletionRing {
 public:
  static absl::StatusOr<std::unique_ptr<CompletionRing>> Create(uint64_t session_id);
  ~CompletionRing();
  CompletionRing(const CompletionRing&) = delete;
  CompletionRing& operator=(const CompletionRing&) = delete;

  // The memfd the client maps (kCompletionPageBytes).
  int fd() const { return fd_.get(); }
  // The schedule cursor the client writes: steps started so far. Only ever read as a hint.
  uint64_t cursor() const { return page_->header.cursor.load(std::memory_order_acquire); }
  // The client's version bit `bit` (< kVersionBits), as it last wrote it. A hint too.
  bool version(uint32_t bit) const {
    return (page_->header.versions[bit / 64].load(std::memory_order_acquire) >> (bit % 64)) & 1;
  }

  // Takes a free slot and marks it pending. RESOURCE_EXHAUSTED when every slot is pending or not
  // yet acknowledged by the client.
  absl::StatusOr<SlotToken> Post();
  // Completes a pending slot and wakes its waiters.
  void Complete(SlotToken token, const absl::Status& status);
  // Post and Complete at once: for requests that are done when they are answered.
  absl::StatusOr<SlotToken> PostCompleted(const absl::Status& status);

  size_t pending() const;

 private:
  CompletionRing(UniqueFd fd, CompletionPage* page);

  UniqueFd fd_;
  CompletionPage* const page_;
  mutable absl::Mutex mu_;
  uint32_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint32_t> sequence_ ABSL_GUARDED_BY(mu_);  // 0: never used
  std::vector<bool> pending_ ABSL_GUARDED_BY(mu_);
  size_t pending_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t errors_ ABSL_GUARDED_BY(mu_) = 0;  // error records written
};

}  // namespace tierd::daemon
