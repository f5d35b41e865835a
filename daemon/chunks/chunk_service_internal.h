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

}  // namespace tierd::daemon
