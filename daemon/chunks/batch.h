// The completion of a request's moves (or of the daemon's own), shared by the chunk service and
// the Mover.
#pragma once

#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/completion_page.h"
#include "daemon/chunks/session.h"

namespace tierd::daemon {

// A batch of asynchronous moves sharing one completion token. Holds the session so that its
// completion page outlives the moves.
struct Batch {
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

}  // namespace tierd::daemon
