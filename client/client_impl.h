// The client's session, as the rooms of Client share it (client.cc, client_node.cc,
// client_bases.cc): the mappings of the daemon's segments, the conversions between the API's
// types and the protocol's, and Client::Impl. Internal to the client library.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cuda_session.h"
#include "common/completion_page.h"
#include "common/session_protocol.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
#include "tierd/client.hpp"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd {

namespace pb = ::tierd::v1;

namespace client_internal {

inline absl::Status FromGrpc(const grpc::Status& s, absl::string_view rpc) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(rpc, ": ", s.error_message()));
}

// A shared mapping of a whole fd.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, size_t size) : base_(base), size_(size) {}
  Mapping(Mapping&& o) noexcept
      : base_(std::exchange(o.base_, nullptr)), size_(o.size_), read_only_(o.read_only_) {}
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      Reset();
      base_ = std::exchange(o.base_, nullptr);
      size_ = o.size_;
      read_only_ = o.read_only_;
    }
    return *this;
  }
  ~Mapping() { Reset(); }
  void* base() const { return base_; }
  size_t size() const { return size_; }

  // Read-only where the daemon passed the fd read-only (a sealed shared base's segment): a write
  // through the mapping faults rather than reaching memory other processes read.
  static absl::StatusOr<Mapping> Map(int fd, size_t size, absl::string_view what) {
    const int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return absl::ErrnoToStatus(errno, absl::StrCat("fcntl of ", what));
    const bool read_only = (flags & O_ACCMODE) == O_RDONLY;
    void* base =
        mmap(nullptr, size, read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) return absl::ErrnoToStatus(errno, absl::StrCat("mmap of ", what));
    Mapping m(base, size);
    m.read_only_ = read_only;
    return m;
  }
  bool read_only() const { return read_only_; }

 private:
  void Reset() {
    if (base_ != nullptr) munmap(base_, size_);
    base_ = nullptr;
  }
  void* base_ = nullptr;
  size_t size_ = 0;
  bool read_only_ = false;
};

// A segment this process has mapped: host memory (host tier, emulated device), registered with
// CUDA once this process uses the GPU, or GPU memory. Members are destroyed in reverse order: the
// registration goes before the mapping it covers.
struct MappedSegment {
  uint64_t generation = 0;
  Mapping mapping;
  client_internal::HostRegistration registration;
  std::unique_ptr<client_internal::DeviceMapping> device;
  bool host_accessible = true;
  char* base() const { return device ? device->base() : static_cast<char*>(mapping.base()); }
};

inline uint64_t SegmentKey(Tier tier, uint32_t segment) {
  return (static_cast<uint64_t>(tier) << 32) | segment;
}

inline Tier FromProto(pb::Tier t) { return static_cast<Tier>(static_cast<int>(t)); }
inline pb::Tier ToProto(Tier t) { return static_cast<pb::Tier>(static_cast<int>(t)); }

inline ChunkInfo FromProto(const pb::ChunkInfo& c) {
  ChunkInfo info;
  info.id = c.chunk_id();
  info.size = c.size_bytes();
  info.name = c.name();
  info.persistent = c.persistent();
  info.tags.assign(c.tags().begin(), c.tags().end());
  info.home = FromProto(c.home_tier());
  for (int t : c.resident_tiers()) info.resident.push_back(static_cast<Tier>(t));
  for (int t : c.dirty_tiers()) info.dirty.push_back(static_cast<Tier>(t));
  info.moving = c.state() == pb::CHUNK_STATE_MOVING;
  info.pins = c.pins();
  info.owner_session = c.owner_session();
  info.lost = c.lost();
  info.transient = c.transient();
  info.base = c.base();
  for (const pb::TierSpace& s : c.space()) info.space.emplace_back(FromProto(s.tier()), s.bytes());
  return info;
}

template <typename Repeated>
void AddIds(Repeated* out, std::span<const ChunkId> ids) {
  out->Reserve(static_cast<int>(ids.size()));
  for (ChunkId id : ids) out->AddAlreadyReserved(id);
}

}  // namespace client_internal

// One session with the daemon: the session socket, the completion page, the segments mapped
// into this process (with their CUDA registrations) and the gRPC stub, shared by the rooms of
// Client (client.cc: the session and its chunks; client_node.cc: the node and schedules;
// client_bases.cc: shared bases and imports).
struct Client::Impl {
  ~Impl() {
    StopWatcher();
    EndSession();
  }

  // Ends the session and waits (boundedly) until the daemon has: it closes its end of the session
  // socket only after the session's chunks and leases are gone, so a name this session held can
  // be opened again as soon as the client is destroyed.
  void EndSession() {
    if (!session_socket) return;
    if (shutdown(session_socket.get(), SHUT_WR) != 0) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    for (;;) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      if (left <= 0) return;
      pollfd p{session_socket.get(), POLLIN, 0};
      const int n = poll(&p, 1, static_cast<int>(left));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0 || (p.revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) return;
      char byte;
      const ssize_t got = recv(session_socket.get(), &byte, 1, MSG_DONTWAIT);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) return;  // closed
    }
  }

  ClientOptions options;
  UniqueFd session_socket;
  uint64_t session_id = 0;
  uint32_t uid = 0;
  std::string credential;  // "<id>:<token>"
  client_internal::Mapping completion_mapping;
  CompletionPage* page = nullptr;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Tierd::Stub> stub;

  // Watches the session socket: when the daemon goes away, fails this session's pending requests
  // so that no host wait and no GPU stream wait on them blocks forever.
  std::thread watcher;
  UniqueFd watcher_stop;  // eventfd
  std::atomic<bool> daemon_gone{false};

  absl::Mutex socket_mu;  // one request/reply on the session socket at a time
  absl::Mutex segments_mu;
  // Declared before `segments`: destroyed after the registrations and mappings that use it.
  std::unique_ptr<client_internal::CudaSession> cuda ABSL_GUARDED_BY(segments_mu);
  client_internal::HostRegistration page_registration ABSL_GUARDED_BY(segments_mu);
  std::string stream_wait_error ABSL_GUARDED_BY(segments_mu);  // why the page is not registered
  uint64_t unregistered_segments ABSL_GUARDED_BY(segments_mu) = 0;
  absl::flat_hash_map<uint64_t, client_internal::MappedSegment> segments
      ABSL_GUARDED_BY(segments_mu);

  absl::Status StartWatcher() {
    int fd = eventfd(0, EFD_CLOEXEC);
    if (fd < 0) return absl::ErrnoToStatus(errno, "eventfd");
    watcher_stop = UniqueFd(fd);
    watcher = std::thread([this] { Watch(); });
    return absl::OkStatus();
  }

  void StopWatcher() {
    if (!watcher.joinable()) return;
    const uint64_t one = 1;
    (void)!write(watcher_stop.get(), &one, sizeof(one));
    watcher.join();
  }

  void Watch() {
    pollfd fds[2] = {{session_socket.get(), 0, 0}, {watcher_stop.get(), POLLIN, 0}};
    for (;;) {
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[1].revents != 0) return;
      if ((fds[0].revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
        FailPendingRequests();
        return;
      }
    }
  }

  // The daemon closed the session: completes every pending slot as failed (UNAVAILABLE) and wakes
  // its waiters. A GPU stream waiting on the slot's word is released too; its work runs on data
  // that never arrived, and the request's status says so.
  void FailPendingRequests() {
    daemon_gone.store(true, std::memory_order_release);
    uint32_t failed = 0;
    for (uint32_t i = 0; i < kCompletionSlots; ++i) {
      CompletionSlot& slot = page->slots[i];
      uint32_t word = slot.word.load(std::memory_order_acquire);
      if (SlotStateOf(word) != SlotState::kPending) continue;
      const SlotToken token{i, SlotSequence(word)};
      slot.code.store(static_cast<int32_t>(absl::StatusCode::kUnavailable),
                      std::memory_order_relaxed);
      RecordError(*page, failed++, token,
                  "the tierd daemon went away before this request completed (the session socket "
                  "closed); reconnect once it is back");
      if (slot.word.compare_exchange_strong(word, SlotWord(token.sequence, SlotState::kFailed),
                                            std::memory_order_release)) {
        FutexWakeAll(&slot.word);
      }
    }
  }

  // Opens the daemon's GPU (by UUID) in this process, registers the completion page for stream
  // waits and, unless the options say not to, the host segments mapped so far (later ones are
  // registered as they are mapped).
  absl::Status OpenCudaLocked(absl::string_view uuid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_mu) {
    if (cuda != nullptr) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<client_internal::CudaSession>> opened =
        client_internal::CudaSession::Open(uuid);
    if (!opened.ok()) return opened.status();
    // Without the page registered, GPU stream waits are unavailable (StreamWait says why); the
    // device tier and host waits still work.
    absl::StatusOr<client_internal::HostRegistration> page_reg =
        (*opened)->RegisterHost(page, kCompletionPageBytes);
    if (page_reg.ok()) {
      page_registration = std::move(*page_reg);
    } else {
      stream_wait_error = absl::StrCat("registering the completion page with CUDA failed (",
                                       page_reg.status().message(), ")");
      std::fprintf(stderr, "tierd client: GPU stream waits disabled: %s\n",
                   stream_wait_error.c_str());
    }
    cuda = std::move(*opened);
    if (options.cuda_register_host) {
      for (auto& [key, segment] : segments) {
        if (segment.device != nullptr || segment.registration.registered()) continue;
        RegisterSegment(key, segment);
      }
    }
    return absl::OkStatus();
  }

  // Registers a host segment for DMA. A segment the driver refuses stays usable: copies from it
  // are staged through the driver, slower, and the first refusal is reported on stderr.
  void RegisterSegment(uint64_t key, client_internal::MappedSegment& segment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_mu) {
    absl::StatusOr<client_internal::HostRegistration> reg = cuda->RegisterHost(
        segment.mapping.base(), segment.mapping.size(), segment.mapping.read_only());
    if (reg.ok()) {
      segment.registration = std::move(*reg);
      return;
    }
    if (unregistered_segments++ == 0) {
      std::fprintf(stderr,
                   "tierd client: host segment %u not registered with CUDA (%s): copies from "
                   "unregistered segments are staged by the driver "
                   "(ClientOptions::cuda_register_host = false skips registering)\n",
                   static_cast<unsigned>(key & 0xffffffffu),
                   std::string(reg.status().message()).c_str());
    }
  }

  // One unary call with the session credential and the deadline.
  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (pb::Tierd::Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Response*),
                    const Request& request, Response* response, absl::string_view name) const {
    grpc::ClientContext ctx;
    ctx.AddMetadata(kSessionMetadataKey, credential);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
    return client_internal::FromGrpc((stub.get()->*method)(&ctx, request, response), name);
  }

  // Maps a segment received from the daemon: host memory is mmapped; GPU memory is imported on the
  // GPU named by `device_uuid`, unless `emulated` (host memory standing in for a GPU's).
  absl::Status AddSegment(Tier tier, const SegmentDescriptor& d, UniqueFd fd, bool emulated,
                          absl::string_view device_uuid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_mu) {
    client_internal::MappedSegment mapped;
    mapped.generation = d.generation;
    const uint64_t key = client_internal::SegmentKey(tier, d.segment);
    if (tier == Tier::kDevice && !emulated) {
      if (absl::Status s = OpenCudaLocked(device_uuid); !s.ok()) return s;
      absl::StatusOr<std::unique_ptr<client_internal::DeviceMapping>> imported =
          cuda->Import(fd.get(), d.size_bytes);
      if (!imported.ok()) return imported.status();
      mapped.device = std::move(*imported);
      mapped.host_accessible = false;
    } else {
      absl::StatusOr<client_internal::Mapping> m = client_internal::Mapping::Map(
          fd.get(), d.size_bytes, absl::StrCat(TierName(tier), " segment ", d.segment));
      if (!m.ok()) return m.status();
      mapped.mapping = std::move(*m);
      if (tier == Tier::kHost && cuda != nullptr && options.cuda_register_host) {
        RegisterSegment(key, mapped);
      }
    }
    // The old mapping (another generation) goes first, its registration before its memory.
    segments.erase(key);
    segments.emplace(key, std::move(mapped));
    return absl::OkStatus();
  }

  // The address of `offset` in a segment of `tier`, mapping (or remapping) the segment as needed.
  absl::StatusOr<std::pair<char*, bool>> SegmentAddress(Tier tier, uint32_t segment,
                                                        uint64_t generation, uint64_t offset) {
    absl::MutexLock lock(&segments_mu);
    auto it = segments.find(client_internal::SegmentKey(tier, segment));
    if (it == segments.end() || it->second.generation != generation) {
      MapSegmentRequest request{};
      request.header = MakeHeader(SessionMessageType::kMapSegment);
      request.segment = segment;
      request.tier = static_cast<uint32_t>(tier);
      MapSegmentReply reply{};
      std::vector<UniqueFd> fds;
      {
        absl::MutexLock socket_lock(&socket_mu);
        if (absl::Status s = SendWithFds(session_socket.get(), &request, sizeof(request), {});
            !s.ok()) {
          return s;
        }
        absl::StatusOr<size_t> n =
            ReceiveWithFds(session_socket.get(), &reply, sizeof(reply), &fds);
        if (!n.ok()) return n.status();
        if (*n != sizeof(reply) || reply.header.magic != kSessionMagic ||
            reply.header.type != SessionMessageType::kMapSegmentReply) {
          return absl::UnavailableError("the daemon closed the session socket or sent garbage");
        }
      }
      if (reply.status_code != 0) {
        return absl::Status(static_cast<absl::StatusCode>(reply.status_code),
                            absl::StrCat("mapping segment ", segment, ": ", reply.message));
      }
      if (fds.size() != 1) return absl::InternalError("segment reply without an fd");
      const std::string uuid(reply.device_uuid,
                             strnlen(reply.device_uuid, sizeof(reply.device_uuid)));
      if (absl::Status s =
              AddSegment(tier, reply.segment, std::move(fds[0]), reply.emulated != 0, uuid);
          !s.ok()) {
        return s;
      }
      it = segments.find(client_internal::SegmentKey(tier, segment));
      if (it->second.generation != generation) {
        return absl::AbortedError(
            absl::StrCat("segment ", segment, " changed while it was being mapped; retry"));
      }
    }
    return std::pair<char*, bool>(it->second.base() + offset, it->second.host_accessible);
  }
};

}  // namespace tierd
