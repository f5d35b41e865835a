#include "daemon/api/session_broker.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/fmt_absl.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"
#include "daemon/util/log_limiter.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

bool ValidHeader(const SessionMessageHeader& h, SessionMessageType type) {
  return h.magic == kSessionMagic && h.version == kSessionProtocolVersion && h.type == type;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SessionBroker>> SessionBroker::Start(
    UniqueFd listener, SessionRegistry* sessions, ChunkService* chunks, Importer* importer,
    SegmentPool* host, SegmentPool* device, DeviceProbe devices, uint32_t connections_per_uid,
    MemoryTrimmer* trimmer) {
  UniqueFd epoll(epoll_create1(EPOLL_CLOEXEC));
  if (!epoll) return absl::ErrnoToStatus(errno, "epoll_create1");
  UniqueFd wake(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) return absl::ErrnoToStatus(errno, "eventfd");
  for (int fd : {listener.get(), wake.get()}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::ErrnoToStatus(errno, "epoll_ctl(ADD)");
    }
  }
  std::unique_ptr<SessionBroker> broker(
      new SessionBroker(std::move(listener), std::move(epoll), std::move(wake), sessions, chunks,
                        importer, host, device, std::move(devices), connections_per_uid, trimmer));
  broker->reserve_ = UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!broker->reserve_) return absl::ErrnoToStatus(errno, "open('/dev/null')");
  broker->thread_ = std::thread([b = broker.get()] { b->Run(); });
  return broker;
}

SessionBroker::SessionBroker(UniqueFd listener, UniqueFd epoll, UniqueFd wake,
                             SessionRegistry* sessions, ChunkService* chunks, Importer* importer,
                             SegmentPool* host, SegmentPool* device, DeviceProbe devices,
                             uint32_t connections_per_uid, MemoryTrimmer* trimmer)
    : listener_(std::move(listener)),
      epoll_(std::move(epoll)),
      wake_(std::move(wake)),
      sessions_(sessions),
      chunks_(chunks),
      importer_(importer),
      host_(host),
      device_(device),
      devices_(std::move(devices)),
      connections_per_uid_(connections_per_uid),
      trimmer_(trimmer) {}

SessionBroker::~SessionBroker() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_.get(), &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  std::vector<int> fds;
  for (const auto& [fd, conn] : connections_) fds.push_back(fd);
  for (int fd : fds) Close(fd);
}

void SessionBroker::Run() {
  epoll_event events[64];
  for (;;) {
    int n = epoll_wait(epoll_.get(), events, 64, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::critical("session broker: epoll_wait failed: {}", std::strerror(errno));
      return;
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_.get()) return;
      if (fd == listener_.get()) {
        Accept();
        continue;
      }
      auto it = connections_.find(fd);
      if (it == connections_.end()) continue;
      bool keep = !(events[i].events & (EPOLLHUP | EPOLLERR));
      // Read what is pending first, even when the peer has hung up afterwards.
      if (events[i].events & EPOLLIN) keep = Serve(*it->second) && keep;
      if (!keep) Close(fd);
    }
  }
}

namespace {

// The peer's supplementary groups (who may open a base shared with a group); none where the
// kernel cannot say (SO_PEERGROUPS, Linux 4.13).
std::vector<uint32_t> PeerGroups(int fd) {
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 2; ++attempt) {
    socklen_t len = groups.size() * sizeof(gid_t);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return {groups.begin(), groups.end()};
    }
    if (errno != ERANGE || len / sizeof(gid_t) > 65536) break;
    groups.resize(len / sizeof(gid_t));
  }
  return {};
}

}  // namespace

void SessionBroker::Accept() {
  for (;;) {
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      if (errno == EMFILE || errno == ENFILE) {
        Shed(errno);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
                 errno != ECONNABORTED) {
        TIERD_LOG_LIMITED(warn, "session broker: accept failed: {}", std::strerror(errno));
      }
      return;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      TIERD_LOG_LIMITED(warn, "session broker: SO_PEERCRED failed: {}", std::strerror(errno));
      continue;
    }
    uint32_t& held = connections_by_uid_[cred.uid];
    if (held >= connections_per_uid_) {
      TIERD_LOG_LIMITED(warn,
                        "session broker: uid {} (pid {}) already holds {} connections, the most "
                        "one user may (limits.connections_per_uid); closed the new one",
                        cred.uid, cred.pid, held);
      continue;  // closing it tells the client
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd.get();
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd.get(), &ev) != 0) {
      TIERD_LOG_LIMITED(warn, "session broker: epoll_ctl failed: {}", std::strerror(errno));
      continue;
    }
    ++held;
    auto conn = std::make_unique<Connection>();
    conn->peer = PeerCredentials{cred.uid, cred.gid, cred.pid, PeerGroups(fd.get())};
    const int raw = fd.get();
    conn->fd = std::move(fd);
    connections_[raw] = std::move(conn);
  }
}

void SessionBroker::Shed(int err) {
  size_t shed = 0;
  while (reserve_) {
    reserve_.Reset();
    const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) close(fd);
    reserve_ = UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (fd < 0) break;  // none pending
    ++shed;
  }
  TIERD_LOG_LIMITED(err,
                    "session broker: out of file descriptors ({}) with {} connections open; "
                    "closed {} new connection(s). Raise LimitNOFILE (ulimit -n) or lower "
                    "limits.connections_per_uid",
                    std::strerror(err), connections_.size(), shed);
  if (!reserve_) {
    // Another thread took the fd meanwhile: pause rather than spin on a readable listener.
    absl::SleepFor(absl::Milliseconds(10));
    reserve_ = UniqueFd(open("/dev/null", O_RDONLY | O_CLOEXEC));
  }
}

bool SessionBroker::Serve(Connection& conn) {
  // One message per readiness event; epoll is level-triggered and reports the rest.
  union {
    SessionMessageHeader header;
    HelloRequest hello;
    MapSegmentRequest map;
    ImportRequest import;
  } msg{};
  // Only an import carries an fd; those sent with other messages are closed.
  std::vector<UniqueFd> fds;
  absl::StatusOr<size_t> got = ReceiveWithFds(conn.fd.get(), &msg, sizeof(msg), &fds);
  if (!got.ok() || *got == 0) return false;  // error or orderly close
  if ((*got == sizeof(HelloRequest) || *got == kHelloRequestWithoutJob) &&
      ValidHeader(msg.header, SessionMessageType::kHello)) {
    return Hello(conn, msg.hello);
  }
  if (*got == sizeof(MapSegmentRequest) &&
      ValidHeader(msg.header, SessionMessageType::kMapSegment)) {
    return MapSegment(conn, msg.map);
  }
  if (*got >= kImportRequestHead && ValidHeader(msg.header, SessionMessageType::kImport)) {
    return Import(conn, msg.import, *got, std::move(fds));
  }
  TIERD_LOG_LIMITED(warn,
                    "session broker: malformed message ({} bytes) from pid {} uid {}; closing",
                    *got, conn.peer.pid, conn.peer.uid);
  return false;
}

bool SessionBroker::Hello(Connection& conn, const HelloRequest& request) {
  HelloReply reply{};
  reply.header = MakeHeader(SessionMessageType::kHelloReply);
  if (conn.session != 0) {
    reply.status_code = static_cast<int32_t>(absl::StatusCode::kFailedPrecondition);
    CopyText(reply.message, "this connection already has a session");
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  }
  std::string name(request.client_name, strnlen(request.client_name, sizeof(request.client_name)));
  // Zeroed by the union when an older client sent no job.
  std::string job(request.job, strnlen(request.job, sizeof(request.job)));
  absl::StatusOr<std::shared_ptr<Session>> session = sessions_->Open(conn.peer, name, job);
  if (!session.ok()) {
    reply.status_code = static_cast<int32_t>(session.status().code());
    CopyText(reply.message, session.status().message());
    TIERD_LOG_LIMITED(warn, "session broker: cannot open a session for pid {} (uid {}): {}",
                      conn.peer.pid, conn.peer.uid, session.status().message());
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  }
  conn.session = (*session)->id;
  conn.opened = *session;
  reply.uid = conn.peer.uid;
  reply.session_id = (*session)->id;
  CopyText(reply.token_hex, (*session)->TokenHex());

  std::vector<UniqueFd> owned;
  std::vector<int> fds = {(*session)->completions->fd()};
  for (const SegmentInfo& info : host_->SegmentsOf(conn.peer.uid)) {
    if (reply.segment_count == kMaxSegmentsPerHello) break;  // the rest via kMapSegment
    SegmentInfo current;
    absl::StatusOr<UniqueFd> fd = host_->SegmentFd(info.segment, conn.peer.uid, &current);
    if (!fd.ok()) continue;  // it changed hands meanwhile
    reply.segments[reply.segment_count++] =
        SegmentDescriptor{current.segment, 0, current.generation, current.size};
    fds.push_back(fd->get());
    owned.push_back(std::move(*fd));
  }
  TIERD_LOG_LIMITED(info, "{} opened", (*session)->Describe());
  return SendWithFds(conn.fd.get(), &reply, sizeof(reply), fds).ok();
}

bool SessionBroker::MapSegment(Connection& conn, const MapSegmentRequest& request) {
  MapSegmentReply reply{};
  reply.header = MakeHeader(SessionMessageType::kMapSegmentReply);
  if (conn.session == 0) {
    reply.status_code = static_cast<int32_t>(absl::StatusCode::kFailedPrecondition);
    CopyText(reply.message, "open a session (hello) before mapping segments");
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  }
  reply.tier = request.tier;
  SegmentPool* pool = request.tier == static_cast<uint32_t>(TierKind::kDevice) ? device_
                      : request.tier == static_cast<uint32_t>(TierKind::kHost) ? host_
                                                                               : nullptr;
  if (pool == nullptr) {
    reply.status_code = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
    CopyText(reply.message, absl::StrCat("tier ", request.tier, " has no segments to map"));
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  }
  if (pool == device_ && !devices_.devices.empty()) {
    reply.emulated = devices_.devices[0].emulated ? 1 : 0;
    CopyText(reply.device_uuid, devices_.devices[0].uuid);
  }
  SegmentInfo info;
  absl::StatusOr<UniqueFd> fd = pool->SegmentFd(request.segment, conn.peer.uid, &info);
  if (const uint32_t owner = pool->OwnerOf(request.segment);
      !fd.ok() && pool == host_ && owner >= kFirstBaseOwner && owner != kNoTenant) {
    // A shared base's segment: for the sessions holding the base, read-only once it is sealed.
    absl::StatusOr<bool> writable = chunks_->MayMapBaseSegment(*conn.opened, owner);
    fd = writable.ok() ? pool->SegmentFd(request.segment, owner, &info, !*writable)
                       : absl::StatusOr<UniqueFd>(writable.status());
  }
  if (!fd.ok()) {
    reply.status_code = static_cast<int32_t>(fd.status().code());
    CopyText(reply.message, fd.status().message());
    TIERD_LOG_LIMITED(warn, "session {}: refused segment {}: {}", conn.session, request.segment,
                      fd.status().message());
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  }
  reply.segment = SegmentDescriptor{info.segment, 0, info.generation, info.size};
  int raw = fd->get();
  return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {&raw, 1}).ok();
}

bool SessionBroker::Import(Connection& conn, const ImportRequest& request, size_t size,
                           std::vector<UniqueFd> fds) {
  auto refuse = [&conn](absl::Status why) {
    ImportReply reply{};
    reply.header = MakeHeader(SessionMessageType::kImportReply);
    reply.status_code = static_cast<int32_t>(why.code());
    CopyText(reply.message, why.message());
    return SendWithFds(conn.fd.get(), &reply, sizeof(reply), {}).ok();
  };
  if (request.count == 0 || request.count > kMaxImportRanges ||
      size != kImportRequestHead + request.count * sizeof(ImportRange)) {
    TIERD_LOG_LIMITED(warn, "session broker: malformed import ({} bytes, {} ranges) from pid {}",
                      size, request.count, conn.peer.pid);
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "import: 1 to ", kMaxImportRanges, " ranges, the message's length matching them")));
  }
  if (fds.size() != 1) {
    return refuse(absl::InvalidArgumentError("import: the message carries one fd, the file's"));
  }
  if (conn.session == 0) {
    return refuse(absl::FailedPreconditionError("open a session (hello) before importing"));
  }
  ImportJob job;
  job.session = conn.opened;
  job.chunk = request.chunk;
  job.file = std::move(fds[0]);
  job.file_size = request.file_size;
  job.file_mtime_ns = request.file_mtime_ns;
  job.ranges.assign(request.ranges, request.ranges + request.count);
  job.reply_to = UniqueFd(fcntl(conn.fd.get(), F_DUPFD_CLOEXEC, 0));
  if (!job.reply_to) return refuse(absl::ErrnoToStatus(errno, "import: dup"));
  if (absl::Status s = importer_->Submit(std::move(job)); !s.ok()) return refuse(s);
  return true;
}

void SessionBroker::Close(int fd) {
  auto it = connections_.find(fd);
  if (it == connections_.end()) return;
  std::unique_ptr<Connection> conn = std::move(it->second);
  connections_.erase(it);
  epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr);
  if (auto n = connections_by_uid_.find(conn->peer.uid);
      n != connections_by_uid_.end() && --n->second == 0) {
    connections_by_uid_.erase(n);
  }
  if (conn->session == 0) return;
  std::shared_ptr<Session> session = sessions_->Close(conn->session);
  if (session == nullptr) {
    importer_->EndSession(conn->session, nullptr);
    return;
  }
  // Its chunks go once no import writes into them: now, or when its running import has stopped
  // (on the importer's thread; this loop never waits for a read).
  importer_->EndSession(session->id, [chunks = chunks_, trimmer = trimmer_, session] {
    const size_t freed = chunks->CloseSession(*session);
    TIERD_LOG_LIMITED(info, "{} ended: reclaimed {} scratch chunks", session->Describe(), freed);
    if (trimmer != nullptr) trimmer->Note();
  });
}

}  // namespace tierd::daemon
