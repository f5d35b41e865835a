// What the node holds, as the chunk service reports it: a session's chunks and every chunk on the
// node a page at a time, what each session holds, and the node-wide figures the metrics endpoint
// reads. A read-only view over the service's table and ledgers, below it; it changes nothing.
//
// Not thread-safe: the chunk service calls it under its lock (the PathMeter has its own).
#pragma once

#include <cstdint>
#include <map>

#include "daemon/chunks/chunk_table.h"
#include "daemon/chunks/path_meter.h"
#include "daemon/chunks/requests.h"
#include "daemon/chunks/session.h"
#include "daemon/chunks/session_ledger.h"
#include "daemon/chunks/shared_bases.h"

namespace tierd::daemon {

class NodeReport {
 public:
  NodeReport(const ChunkTable& chunks, const SessionLedger& sessions, const SharedBases& bases,
             const PathMeter& meter)
      : chunks_(chunks), sessions_(sessions), bases_(bases), meter_(meter) {}
  NodeReport(const NodeReport&) = delete;
  NodeReport& operator=(const NodeReport&) = delete;

  // The session's chunks and its tenant's persistent chunks with id >= page_token, by id; at most
  // `page_size` (0: kDefaultPageSize; capped at kMaxPageSize).
  ChunkPage SessionChunks(const Session& session, ChunkId page_token, uint32_t page_size) const;
  // Every chunk on the node with id >= page_token, by id, with the names of their shared bases.
  ChunkPage AllChunks(ChunkId page_token, uint32_t page_size) const;
  // What each open session holds, by session id: its scratch chunks, and the persistent chunks
  // it holds a lease on.
  std::map<SessionId, SessionHoldings> Holdings() const;
  NodeStats Stats() const;

 private:
  const ChunkTable& chunks_;
  const SessionLedger& sessions_;
  const SharedBases& bases_;
  const PathMeter& meter_;
};

}  // namespace tierd::daemon
