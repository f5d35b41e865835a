// The session socket: accepts client connections, reads each peer's credentials (SO_PEERCRED),
// opens a session, and passes the fds the client may map (SCM_RIGHTS). The connection stays open
// for the session's life; when it closes (client exit, crash or kill) the session ends and its
// pins and scratch chunks are reclaimed at once.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/unique_fd.h"
#include "daemon/chunk_service.h"
#include "daemon/device_probe.h"
#include "daemon/segment_pool.h"
#include "daemon/session.h"

namespace tierd {

class SessionBroker {
 public:
  // Listens on `path` (mode `mode`) and serves it on a thread of its own.
  // `device` is the device tier's pool (null without one) and `devices` names its GPU.
  static absl::StatusOr<std::unique_ptr<SessionBroker>> Start(
      const std::string& path, unsigned mode, SessionRegistry* sessions, ChunkService* chunks,
      SegmentPool* host, SegmentPool* device = nullptr, DeviceProbe devices = {});
  // Stops accepting, ends every session and joins the thread.
  ~SessionBroker();

 private:
  struct Connection {
    UniqueFd fd;
    PeerCredentials peer;
    SessionId session = 0;
  };

  SessionBroker(UniqueFd listener, UniqueFd epoll, UniqueFd wake, SessionRegistry* sessions,
                ChunkService* chunks, SegmentPool* host, SegmentPool* device, DeviceProbe devices);
  void Run();
  void Accept();
  // Returns false when the connection must be closed.
  bool Serve(Connection& conn);
  bool Hello(Connection& conn, const HelloRequest& request);
  bool MapSegment(Connection& conn, const MapSegmentRequest& request);
  void Close(int fd);

  UniqueFd listener_;
  UniqueFd epoll_;
  UniqueFd wake_;  // eventfd: written to stop the loop
  SessionRegistry* const sessions_;
  ChunkService* const chunks_;
  SegmentPool* const host_;
  SegmentPool* const device_;
  const DeviceProbe devices_;
  absl::flat_hash_map<int, std::unique_ptr<Connection>> connections_;  // loop thread only
  std::thread thread_;
};

}  // namespace tierd
