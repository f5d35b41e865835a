// The session socket: accepts client connections, reads each peer's credentials (SO_PEERCRED),
// opens a session, and passes the fds the client may map (SCM_RIGHTS). The connection stays open
// for the session's life; when it closes (client exit, crash or kill) the session ends and its
// pins and scratch chunks are reclaimed at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/api/importer.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/device/device_probe.h"
#include "daemon/tiers/segment_pool.h"
#include "daemon/util/memory_trimmer.h"

namespace tierd::daemon {

class SessionBroker {
 public:
  // Serves the session socket `listener` (bound and listening) on a thread of its own.
  // `device` is the device tier's pool (null without one) and `devices` names its GPU. A user may
  // hold at most `connections_per_uid` connections (limits.connections_per_uid); more are closed
  // at once. `trimmer`, when given, is told of every session that ended (what it held was freed).
  // `importer` runs the sessions' imports and is told before a session ends; it outlives the
  // broker.
  static absl::StatusOr<std::unique_ptr<SessionBroker>> Start(
      UniqueFd listener, SessionRegistry* sessions, ChunkService* chunks, Importer* importer,
      SegmentPool* host, SegmentPool* device = nullptr, DeviceProbe devices = {},
      uint32_t connections_per_uid = UINT32_MAX, MemoryTrimmer* trimmer = nullptr);
  // Stops accepting, ends every session and joins the thread.
  ~SessionBroker();

 private:
  struct Connection {
    UniqueFd fd;
    PeerCredentials peer;
    SessionId session = 0;
    std::shared_ptr<Session> opened;  // the session, once hello opened it
  };

  SessionBroker(UniqueFd listener, UniqueFd epoll, UniqueFd wake, SessionRegistry* sessions,
                ChunkService* chunks, Importer* importer, SegmentPool* host, SegmentPool* device,
                DeviceProbe devices, uint32_t connections_per_uid, MemoryTrimmer* trimmer);
  void Run();
  void Accept();
  // Out of file descriptors: accepts the pending connections with the reserve fd and closes them,
  // so that the level-triggered listener stops reporting them (and spinning).
  void Shed(int err);
  // Returns false when the connection must be closed.
  bool Serve(Connection& conn);
  bool Hello(Connection& conn, const HelloRequest& request);
  bool MapSegment(Connection& conn, const MapSegmentRequest& request);
  // Hands a well-formed import to the importer, which replies when it ends; replies at once when
  // it is refused. `size` is the message's length.
  bool Import(Connection& conn, const ImportRequest& request, size_t size,
              std::vector<UniqueFd> fds);
  void Close(int fd);

  UniqueFd listener_;
  UniqueFd epoll_;
  UniqueFd wake_;  // eventfd: written to stop the loop
  SessionRegistry* const sessions_;
  ChunkService* const chunks_;
  Importer* const importer_;
  SegmentPool* const host_;
  SegmentPool* const device_;
  const DeviceProbe devices_;
  const uint32_t connections_per_uid_;
  MemoryTrimmer* const trimmer_;
  // Loop thread only:
  absl::flat_hash_map<int, std::unique_ptr<Connection>> connections_;
  absl::flat_hash_map<uint32_t, uint32_t> connections_by_uid_;
  UniqueFd reserve_;  // an fd kept free for accepting (and closing) when the process has none
  std::thread thread_;
};

}  // namespace tierd::daemon
