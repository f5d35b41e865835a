// ChunkService's imports: the daemon writes a file's bytes into a chunk that a session holds
// acquired for writing in the host tier (daemon/api/importer.h reads them). One section of the
// service kept in a file of its own; the same lock and rules.
#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "daemon/chunks/chunk_service.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {

absl::StatusOr<std::span<char>> ChunkService::BeginImport(const Session& session, ChunkId id) {
  absl::MutexLock lock(&mu_);
  if (session.ended) {
    return absl::FailedPreconditionError(absl::StrCat(session.Describe(), " has ended"));
  }
  absl::StatusOr<std::vector<ChunkMeta*>> chunks = Resolve(session, {&id, 1});
  if (!chunks.ok()) return chunks.status();
  ChunkMeta& chunk = *chunks->front();
  SessionLedger::State& state = sessions_.Of(session);
  auto pins = state.pins.find(id);
  // A write in effect leaves the written copy the only valid one: in the host tier, it is there.
  if (pins == state.pins.end() || pins->second.writes == 0 ||
      !chunk.resident.contains(TierKind::kHost) || chunk.state != ChunkState::kReady) {
    return absl::FailedPreconditionError(
        absl::StrCat("import into chunk ", id, ": ", session.Describe(),
                     " must hold it acquired for writing in the host tier, its data there"));
  }
  // One more write pin in the session's name: the chunk is neither moved, copied nor freed until
  // EndImport, whatever the client releases meanwhile.
  Hold(chunk);
  ++pins->second.count;
  ++pins->second.writes;
  ++chunk.writers;
  void* address = tier(TierKind::kHost)->Address(chunk.placement[TierKind::kHost]);
  return std::span<char>(static_cast<char*>(address), chunk.size);
}

void ChunkService::EndImport(const Session& session, ChunkId id) {
  {
    absl::MutexLock lock(&mu_);
    // An ended session's pins went with it (the importer is told before it ends).
    if (session.ended) return;
  }
  if (absl::Status s = Release(session, {&id, 1}); !s.ok()) {
    spdlog::error("{}: the pin of an import into chunk {} was not there to drop: {}",
                  session.Describe(), id, s.message());
  }
}

}  // namespace tierd::daemon
