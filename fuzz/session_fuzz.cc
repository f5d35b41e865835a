// The session socket, as a hostile local client speaks it: a connection to a real broker (its
// epoll thread, registry, chunk service and host pool) that sends the packets the input spells,
// with or without file descriptors attached, and reads what comes back. Nothing a client sends
// may crash the broker, make it hand out a segment of another tenant, or leave a session open
// once the connection is gone.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"
#include "daemon/api/session_broker.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/chunks/session.h"
#include "daemon/tiers/host/host_memory.h"
#include "fuzz/scratch_dir.h"
#include "spdlog/spdlog.h"

namespace tierd::daemon {
namespace {

struct Daemon {
  std::string path;
  std::unique_ptr<SegmentPool> host;
  std::unique_ptr<ChunkService> chunks;
  std::unique_ptr<SessionRegistry> sessions;
  std::unique_ptr<Importer> importer;
  std::unique_ptr<SessionBroker> broker;
};

Daemon& TheDaemon() {
  static Daemon* d = [] {
    spdlog::set_level(spdlog::level::off);
    auto* d = new Daemon;
    const std::string dir = FuzzScratchDir("/tmp", "session");
    d->path = absl::StrCat(dir, "/tierd.session.sock");
    auto host = CreateHostPool({.capacity = 32 << 20,
                                .segment_size = 16 << 20,
                                .huge_pages = HugePagePolicy::kNever,
                                .lock_memory = false});
    if (!host.ok()) abort();
    d->host = std::move(*host);
    d->chunks = std::make_unique<ChunkService>(NodeTiers(d->host.get()));
    d->sessions = std::make_unique<SessionRegistry>(/*sessions_per_uid=*/64);
    // A segment of this tenant, so that map requests can succeed too.
    auto listener = ListenSeqpacket(d->path, 0600);
    if (!listener.ok()) abort();
    d->importer = std::make_unique<Importer>(d->chunks.get());
    auto broker = SessionBroker::Start(std::move(*listener), d->sessions.get(), d->chunks.get(),
                                       d->importer.get(), d->host.get(), nullptr, {},
                                       /*connections_per_uid=*/64);
    if (!broker.ok()) abort();
    d->broker = std::move(*broker);
    return d;
  }();
  return *d;
}

}  // namespace
}  // namespace tierd::daemon

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tierd;
  using namespace tierd::daemon;
  Daemon& d = TheDaemon();
  auto sock = ConnectSeqpacket(d.path);
  if (!sock.ok()) abort();
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  // Packets: [flags][length][bytes...]; flags bit 0 attaches an fd, bit 1 makes the packet a
  // well-formed header of the type in the next byte followed by the rest of the bytes.
  size_t pos = 0;
  while (pos + 2 <= size) {
    const uint8_t flags = data[pos];
    size_t length = std::min<size_t>(data[pos + 1] * 4u, size - pos - 2);
    pos += 2;
    std::vector<char> packet(data + pos, data + pos + length);
    pos += length;
    if ((flags & 2) && !packet.empty()) {
      const auto type = static_cast<SessionMessageType>(1 + (packet[0] & 3));
      const SessionMessageHeader header = MakeHeader(type);
      const size_t whole = type == SessionMessageType::kHello        ? sizeof(HelloRequest)
                           : type == SessionMessageType::kMapSegment ? sizeof(MapSegmentRequest)
                                                                     : sizeof(header);
      packet.resize(std::max(packet.size(), whole));
      std::memcpy(packet.data(), &header, sizeof(header));
    }
    std::vector<int> fds;
    if (flags & 1) fds.push_back(null_fd);
    if (!SendWithFds(sock->get(), packet.data(), packet.size(), fds).ok()) break;
    // Read whatever the broker answers (it answers a valid request at once, or hangs up).
    pollfd p{sock->get(), POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char reply[sizeof(HelloReply) + 64];
    std::vector<UniqueFd> got;
    absl::StatusOr<size_t> n = ReceiveWithFds(sock->get(), reply, sizeof(reply), &got);
    if (!n.ok() || *n == 0) break;  // closed by the broker: a malformed request
    if (*n == sizeof(HelloReply)) {
      HelloReply hello;
      std::memcpy(&hello, reply, sizeof(hello));
      // At most the page and the segments the reply lists, all of this uid.
      if (hello.status_code == 0 && got.size() != 1 + hello.segment_count) __builtin_trap();
      if (hello.status_code == 0 && hello.uid != getuid()) __builtin_trap();
    }
  }
  close(null_fd);
  sock->Reset();
  // The session, if one opened, ends with its connection.
  for (absl::Time give_up = absl::Now() + absl::Seconds(5); d.sessions->size() != 0;) {
    if (absl::Now() > give_up) __builtin_trap();
    absl::SleepFor(absl::Microseconds(100));
  }
  return 0;
}
