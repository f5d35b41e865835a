#include "tierd/client.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/cuda_session.h"
#include "common/completion_page.h"
#include "common/cuda_driver.h"
#include "common/session_protocol.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd {

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
    case Tier::kDevice:
      return "device";
  }
  return "?";
}

std::optional<Tier> ParseTier(std::string_view name) {
  for (Tier t : {Tier::kHost, Tier::kNvme, Tier::kDevice}) {
    if (name == TierName(t)) return t;
  }
  return std::nullopt;
}

namespace {

namespace pb = ::tierd::v1;

absl::Status FromGrpc(const grpc::Status& s, absl::string_view rpc) {
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

uint64_t SegmentKey(Tier tier, uint32_t segment) {
  return (static_cast<uint64_t>(tier) << 32) | segment;
}

Tier FromProto(pb::Tier t) { return static_cast<Tier>(static_cast<int>(t)); }
pb::Tier ToProto(Tier t) { return static_cast<pb::Tier>(static_cast<int>(t)); }

ChunkInfo FromProto(const pb::ChunkInfo& c) {
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

}  // namespace

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
  Mapping completion_mapping;
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
  absl::flat_hash_map<uint64_t, MappedSegment> segments ABSL_GUARDED_BY(segments_mu);

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
  void RegisterSegment(uint64_t key, MappedSegment& segment)
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
    return FromGrpc((stub.get()->*method)(&ctx, request, response), name);
  }

  // Maps a segment received from the daemon: host memory is mmapped; GPU memory is imported on the
  // GPU named by `device_uuid`, unless `emulated` (host memory standing in for a GPU's).
  absl::Status AddSegment(Tier tier, const SegmentDescriptor& d, UniqueFd fd, bool emulated,
                          absl::string_view device_uuid)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(segments_mu) {
    MappedSegment mapped;
    mapped.generation = d.generation;
    const uint64_t key = SegmentKey(tier, d.segment);
    if (tier == Tier::kDevice && !emulated) {
      if (absl::Status s = OpenCudaLocked(device_uuid); !s.ok()) return s;
      absl::StatusOr<std::unique_ptr<client_internal::DeviceMapping>> imported =
          cuda->Import(fd.get(), d.size_bytes);
      if (!imported.ok()) return imported.status();
      mapped.device = std::move(*imported);
      mapped.host_accessible = false;
    } else {
      absl::StatusOr<Mapping> m = Mapping::Map(
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
    auto it = segments.find(SegmentKey(tier, segment));
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
      it = segments.find(SegmentKey(tier, segment));
      if (it->second.generation != generation) {
        return absl::AbortedError(
            absl::StrCat("segment ", segment, " changed while it was being mapped; retry"));
      }
    }
    return std::pair<char*, bool>(it->second.base() + offset, it->second.host_accessible);
  }
};

const TierStatus* NodeInfo::tier(Tier t) const {
  for (const TierStatus& s : tiers) {
    if (s.tier == t) return &s;
  }
  return nullptr;
}

const PathStatus* NodeInfo::path(std::string_view name) const {
  for (const PathStatus& p : paths) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (impl->options.socket_dir.empty()) {
    const char* env = std::getenv("TIERD_SOCKET_DIR");
    impl->options.socket_dir = env != nullptr && *env != '\0' ? env : "/run/tierd";
  }
  const std::string session_path = absl::StrCat(impl->options.socket_dir, "/", kSessionSocketName);
  absl::StatusOr<UniqueFd> sock = ConnectSeqpacket(session_path);
  if (!sock.ok()) {
    // On a cluster, a rank's error is read far from its node: the node is named.
    char host[256] = "this node";
    gethostname(host, sizeof(host) - 1);
    return absl::UnavailableError(absl::StrCat(
        "cannot reach tierd on ", host, " at ", session_path, ": ", sock.status().message(),
        " (start the daemon on that node: systemctl start tierd; or set TIERD_SOCKET_DIR to "
        "the socket directory of the one running there)"));
  }
  impl->session_socket = std::move(*sock);

  HelloRequest hello{};
  hello.header = MakeHeader(SessionMessageType::kHello);
  CopyText(hello.client_name, options.client_name);
  std::string job = options.job;
  if (const char* env = std::getenv("TIERD_JOB"); job.empty() && env != nullptr) job = env;
  if (job.size() > static_cast<size_t>(kMaxJobBytes)) {  // CopyText would cut it short
    return absl::InvalidArgumentError(
        absl::StrCat("job label of ", job.size(), " bytes; at most ", kMaxJobBytes));
  }
  CopyText(hello.job, job);
  if (absl::Status s = SendWithFds(impl->session_socket.get(), &hello, sizeof(hello), {});
      !s.ok()) {
    return s;
  }
  HelloReply reply{};
  std::vector<UniqueFd> fds;
  absl::StatusOr<size_t> n =
      ReceiveWithFds(impl->session_socket.get(), &reply, sizeof(reply), &fds);
  if (!n.ok()) return n.status();
  if (*n != sizeof(reply) || reply.header.magic != kSessionMagic ||
      reply.header.version != kSessionProtocolVersion ||
      reply.header.type != SessionMessageType::kHelloReply) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon at ", session_path, " speaks another session protocol (reply of ",
                     *n, " bytes); upgrade the client library or the daemon so that they match"));
  }
  if (reply.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code),
                        absl::StrCat("opening a session: ", reply.message));
  }
  if (fds.size() != 1 + reply.segment_count) {
    return absl::InternalError("session reply carries the wrong number of fds");
  }
  impl->session_id = reply.session_id;
  impl->uid = reply.uid;
  impl->credential = absl::StrCat(reply.session_id, ":", reply.token_hex);

  absl::StatusOr<Mapping> page =
      Mapping::Map(fds[0].get(), kCompletionPageBytes, "completion page");
  if (!page.ok()) return page.status();
  impl->completion_mapping = std::move(*page);
  impl->page = static_cast<CompletionPage*>(impl->completion_mapping.base());
  if (impl->page->header.magic != kCompletionPageMagic ||
      impl->page->header.version != kCompletionPageVersion) {
    return absl::FailedPreconditionError("the daemon's completion page has another format");
  }
  {
    absl::MutexLock lock(&impl->segments_mu);
    for (uint32_t i = 0; i < reply.segment_count; ++i) {
      if (absl::Status s =
              impl->AddSegment(Tier::kHost, reply.segments[i], std::move(fds[1 + i]), false, "");
          !s.ok()) {
        return s;
      }
    }
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReplyBytes);
  args.SetMaxSendMessageSize(kMaxRequestBytes);
  impl->channel = grpc::CreateCustomChannel(
      absl::StrCat("unix:", impl->options.socket_dir, "/", kRpcSocketName),
      grpc::InsecureChannelCredentials(), args);
  impl->stub = pb::Tierd::NewStub(impl->channel);
  if (absl::Status s = impl->StartWatcher(); !s.ok()) return s;
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;  // closing the session socket ends the session

uint64_t Client::session_id() const { return impl_->session_id; }
uint32_t Client::uid() const { return impl_->uid; }

absl::StatusOr<std::vector<ChunkId>> Client::AllocateIds(std::span<const ChunkSpec> specs) {
  pb::AllocateRequest req;
  req.mutable_chunks()->Reserve(static_cast<int>(specs.size()));
  for (const ChunkSpec& spec : specs) {
    pb::ChunkSpec* s = req.add_chunks();
    s->set_size_bytes(spec.size);
    s->set_home_tier(ToProto(spec.home));
    s->set_name(spec.name);
    s->set_persistent(spec.persistent);
    for (const std::string& tag : spec.tags) s->add_tags(tag);
    s->set_open_existing(spec.open_existing);
    s->set_must_exist(spec.must_exist);
    s->set_shared(spec.shared);
    s->set_transient(spec.transient);
  }
  pb::AllocateResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Allocate, req, &resp, "Allocate"); !s.ok()) {
    return s;
  }
  return std::vector<ChunkId>(resp.chunk_ids().begin(), resp.chunk_ids().end());
}

absl::Status Client::Free(std::span<const ChunkId> ids) {
  pb::FreeRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  pb::FreeResponse resp;
  return impl_->Call(&pb::Tierd::Stub::Free, req, &resp, "Free");
}

absl::StatusOr<Acquired> Client::AcquireIds(std::span<const ChunkId> ids, Tier tier,
                                            AccessMode mode) {
  pb::AcquireRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  req.set_tier(ToProto(tier));
  req.set_mode(static_cast<pb::AccessMode>(static_cast<int>(mode)));
  pb::AcquireResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Acquire, req, &resp, "Acquire"); !s.ok()) {
    return s;
  }
  Acquired out;
  out.ready = CompletionToken{resp.ready().slot(), resp.ready().sequence()};
  out.chunks.reserve(resp.locations_size());
  for (const pb::ChunkLocation& loc : resp.locations()) {
    AcquiredChunk chunk{loc.chunk_id(), FromProto(loc.tier()), nullptr, loc.size_bytes()};
    if (chunk.tier == Tier::kHost || chunk.tier == Tier::kDevice) {
      absl::StatusOr<std::pair<char*, bool>> addr =
          impl_->SegmentAddress(chunk.tier, loc.segment(), loc.segment_generation(), loc.offset());
      if (!addr.ok()) {
        // Do not leave the pins behind when the chunks cannot be handed over.
        (void)Release(ids);
        Abandon(out.ready);
        return addr.status();
      }
      chunk.data = addr->first;
      chunk.host_accessible = addr->second;
    }
    out.chunks.push_back(chunk);
  }
  return out;
}

absl::Status Client::Release(std::span<const ChunkId> ids) {
  pb::ReleaseRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  pb::ReleaseResponse resp;
  return impl_->Call(&pb::Tierd::Stub::Release, req, &resp, "Release");
}

absl::StatusOr<CompletionToken> Client::PrefetchIds(std::span<const ChunkId> ids, Tier tier,
                                                    int priority) {
  pb::PrefetchRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  req.set_tier(ToProto(tier));
  req.set_priority(priority);
  pb::PrefetchResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Prefetch, req, &resp, "Prefetch"); !s.ok()) {
    return s;
  }
  return CompletionToken{resp.completion().slot(), resp.completion().sequence()};
}

absl::StatusOr<CompletionToken> Client::EvictIds(std::span<const ChunkId> ids, Tier tier,
                                                 bool keep_source) {
  pb::EvictRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  req.set_tier(ToProto(tier));
  req.set_keep_source(keep_source);
  pb::EvictResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Evict, req, &resp, "Evict"); !s.ok()) {
    return s;
  }
  return CompletionToken{resp.completion().slot(), resp.completion().sequence()};
}

absl::StatusOr<std::vector<ChunkInfo>> Client::Stat(std::span<const ChunkId> ids) {
  pb::StatRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  pb::StatResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Stat, req, &resp, "Stat"); !s.ok()) return s;
  std::vector<ChunkInfo> out;
  out.reserve(resp.chunks_size());
  for (const pb::ChunkInfo& c : resp.chunks()) out.push_back(FromProto(c));
  return out;
}

absl::StatusOr<std::vector<ChunkInfo>> Client::ListChunks(bool all_sessions) {
  std::vector<ChunkInfo> out;
  uint64_t token = 0;
  do {
    pb::ListChunksRequest req;
    req.set_page_token(token);
    req.set_page_size(10000);
    req.set_all_sessions(all_sessions);
    pb::ListChunksResponse resp;
    if (absl::Status s = impl_->Call(&pb::Tierd::Stub::ListChunks, req, &resp, "ListChunks");
        !s.ok()) {
      return s;
    }
    for (const pb::ChunkInfo& c : resp.chunks()) out.push_back(FromProto(c));
    token = resp.next_page_token();
  } while (token != 0);
  return out;
}

absl::StatusOr<NodeInfo> Client::GetNodeInfo(bool list_sessions) {
  pb::GetNodeInfoRequest req;
  req.set_list_sessions(list_sessions);
  pb::GetNodeInfoResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::GetNodeInfo, req, &resp, "GetNodeInfo");
      !s.ok()) {
    return s;
  }
  NodeInfo info;
  info.hostname = resp.hostname();
  info.version = resp.build().version();
  info.cuda = resp.build().cuda();
  for (const pb::TierInfo& t : resp.tiers()) {
    TierStatus status{
        FromProto(t.tier()), t.configured(),         t.capacity_bytes(), t.used_bytes(),
        t.free_bytes(),      t.largest_free_bytes(), t.detail(),         {}};
    for (const pb::RegionInfo& r : t.regions()) {
      status.regions.push_back({r.path(), r.capacity_bytes(), r.used_bytes(), r.block_size()});
    }
    status.io_backend = t.io_backend();
    status.persistent_granule_bytes = t.persistent_granule_bytes();
    info.tiers.push_back(std::move(status));
  }
  for (const pb::DeviceInfo& d : resp.devices()) {
    info.devices.push_back(absl::StrCat(d.uuid(), " ", d.name(), " (", d.memory_bytes(), " B)"));
  }
  if (resp.devices_size() > 0) {
    info.device_uuid = resp.devices(0).uuid();
    info.device_emulated = resp.devices(0).emulated();
    info.device_memory_bytes = resp.devices(0).memory_bytes();
  }
  info.device_status = resp.device_status();
  for (const pb::Fallback& f : resp.fallbacks()) info.fallbacks.emplace_back(f.what(), f.why());
  info.uptime_seconds = resp.uptime_seconds();
  for (const pb::SessionInfo& x : resp.session_list()) {
    info.session_list.push_back({x.id(), x.client_name(), x.uid(), x.pid(),
                                 absl::FromUnixSeconds(x.opened_unix_seconds()), x.chunks(),
                                 x.bytes(), x.pinned_chunks(), x.job(), x.moved_bytes()});
  }
  info.sessions = resp.sessions();
  info.chunks = resp.chunks();
  for (const pb::PathInfo& p : resp.paths()) {
    info.paths.push_back({p.name(), p.bytes_total(), p.moves_total(), p.bytes_per_second(),
                          p.measured(), p.probed_bytes_per_second()});
  }
  for (const pb::TenantInfo& t : resp.tenants()) {
    TenantStatus& out = info.tenants.emplace_back();
    out.uid = t.uid();
    out.user = t.user();
    out.sessions = t.sessions();
    out.chunks = t.chunks();
    out.schedule_accesses = t.schedule_accesses();
    for (const pb::TenantTier& tier : t.tiers()) {
      out.tiers.push_back({FromProto(tier.tier()), tier.used_bytes(), tier.quota_bytes()});
    }
    for (const pb::LimitRefusals& r : t.refusals()) out.refusals.emplace_back(r.limit(), r.count());
  }
  const pb::LimitsInfo& l = resp.limits();
  info.limits = {l.connections_per_uid(),
                 l.sessions_per_uid(),
                 l.chunks_per_session(),
                 l.chunks_per_uid(),
                 l.schedule_accesses_per_session(),
                 l.schedule_accesses_per_uid(),
                 l.trace_steps()};
  return info;
}

absl::StatusOr<DrainStarted> Client::Drain(Tier tier, std::span<const ChunkId> ids) {
  pb::DrainRequest req;
  req.set_tier(ToProto(tier));
  for (ChunkId id : ids) req.add_chunk_ids(id);
  pb::DrainResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::Drain, req, &resp, "Drain"); !s.ok()) {
    return s;
  }
  return DrainStarted{.done = {resp.completion().slot(), resp.completion().sequence()},
                      .chunks = resp.chunks(),
                      .bytes = resp.bytes(),
                      .pinned_chunks = resp.pinned_chunks()};
}

absl::StatusOr<ChunkSet> Client::Allocate(std::span<const ChunkSpec> specs) {
  absl::StatusOr<std::vector<ChunkId>> ids = AllocateIds(specs);
  if (!ids.ok()) return ids.status();
  return ChunkSet(this, std::move(*ids));
}

absl::StatusOr<Acquisition> Client::Acquire(std::span<const ChunkId> ids, Tier tier,
                                            AccessMode mode) {
  absl::StatusOr<Acquired> acquired = AcquireIds(ids, tier, mode);
  if (!acquired.ok()) return acquired.status();
  return Acquisition(this, std::move(*acquired));
}

absl::StatusOr<Completion> Client::Prefetch(std::span<const ChunkId> ids, Tier tier, int priority) {
  absl::StatusOr<CompletionToken> token = PrefetchIds(ids, tier, priority);
  if (!token.ok()) return token.status();
  return Completion(this, *token);
}

absl::StatusOr<Completion> Client::Evict(std::span<const ChunkId> ids, Tier tier,
                                         bool keep_source) {
  absl::StatusOr<CompletionToken> token = EvictIds(ids, tier, keep_source);
  if (!token.ok()) return token.status();
  return Completion(this, *token);
}

absl::Status Client::Poll(CompletionToken token) const {
  absl::StatusOr<SlotState> state =
      PollCompletion(*impl_->page, SlotToken{token.slot, token.sequence});
  if (!state.ok()) return state.status();
  switch (*state) {
    case SlotState::kOk:
      return absl::OkStatus();
    case SlotState::kFailed:
      return absl::Status(static_cast<absl::StatusCode>(impl_->page->slots[token.slot].code.load()),
                          FindError(*impl_->page, SlotToken{token.slot, token.sequence}));
    default:
      return absl::UnavailableError("pending");
  }
}

absl::Status Client::Wait(CompletionToken token, absl::Duration timeout) {
  return WaitCompletion(*impl_->page, SlotToken{token.slot, token.sequence}, timeout);
}

absl::Status Client::SetSchedule(std::span<const ScheduleStep> steps,
                                 const ScheduleOptions& options) {
  pb::SetScheduleRequest req;
  req.mutable_steps()->Reserve(static_cast<int>(steps.size()));
  for (const ScheduleStep& step : steps) {
    pb::ScheduleStep* out = req.add_steps();
    out->mutable_accesses()->Reserve(static_cast<int>(step.size()));
    for (const StepAccess& a : step) {
      pb::StepAccess* access = out->add_accesses();
      access->set_chunk_id(a.id);
      access->set_tier(ToProto(a.tier));
      access->set_mode(static_cast<pb::AccessMode>(static_cast<int>(a.mode)));
      access->set_other_chunk_id(a.other);
      access->set_version_bit(a.version_bit);
    }
  }
  req.set_host_quota_bytes(options.host_quota_bytes);
  req.set_device_quota_bytes(options.device_quota_bytes);
  pb::SetScheduleResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetSchedule, req, &resp, "SetSchedule");
}

absl::Status Client::TraceSchedule(uint32_t steps_per_iteration, const ScheduleOptions& options) {
  if (steps_per_iteration == 0) {
    return absl::InvalidArgumentError("TraceSchedule: an iteration has at least one step");
  }
  pb::SetScheduleRequest req;
  req.set_trace_steps(steps_per_iteration);
  req.set_host_quota_bytes(options.host_quota_bytes);
  req.set_device_quota_bytes(options.device_quota_bytes);
  pb::SetScheduleResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetSchedule, req, &resp, "SetSchedule");
}

void Client::BeginStep(uint64_t k) {
  impl_->page->header.cursor.store(k + 1, std::memory_order_release);
}

absl::Status Client::SetVersion(uint32_t bit, bool value) {
  if (bit >= kVersionBits) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetVersion: bit ", bit, "; there are ", kVersionBits));
  }
  std::atomic<uint64_t>& word = impl_->page->header.versions[bit / 64];
  const uint64_t mask = uint64_t{1} << (bit % 64);
  if (value) {
    word.fetch_or(mask, std::memory_order_release);
  } else {
    word.fetch_and(~mask, std::memory_order_release);
  }
  return absl::OkStatus();
}

absl::StatusOr<SessionStats> Client::GetSessionStats() {
  pb::GetSessionStatsRequest req;
  pb::GetSessionStatsResponse resp;
  if (absl::Status s =
          impl_->Call(&pb::Tierd::Stub::GetSessionStats, req, &resp, "GetSessionStats");
      !s.ok()) {
    return s;
  }
  SessionStats stats;
  stats.acquired_ready = resp.acquired_ready();
  stats.acquired_waited = resp.acquired_waited();
  for (const pb::TierStall& t : resp.stalls()) {
    const absl::Duration d = absl::Seconds(t.stall_seconds());
    if (t.tier() == pb::TIER_HOST) stats.host_stall = d;
    if (t.tier() == pb::TIER_DEVICE) stats.device_stall = d;
  }
  stats.planner_fetches = resp.planner_fetches();
  stats.planner_drops = resp.planner_drops();
  stats.planner_write_backs = resp.planner_write_backs();
  stats.cursor = resp.cursor();
  stats.schedule_steps = resp.schedule_steps();
  stats.tracing = resp.tracing();
  stats.bandwidth_weight = resp.bandwidth_weight();
  return stats;
}

absl::Status Client::SetBandwidthWeight(uint32_t weight) {
  pb::SetBandwidthWeightRequest req;
  req.set_weight(weight);
  pb::SetBandwidthWeightResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SetBandwidthWeight, req, &resp, "SetBandwidthWeight");
}

absl::StatusOr<OpenedBase> Client::OpenBase(const std::string& name, const BaseCreate* create) {
  pb::OpenBaseRequest req;
  req.set_name(name);
  if (create != nullptr) {
    req.set_create(true);
    for (const BaseChunkSpec& c : create->chunks) {
      pb::BaseChunk* out = req.add_chunks();
      out->set_size_bytes(c.size_bytes);
      out->set_home_tier(ToProto(c.home_tier));
    }
    req.set_contents(create->descriptor);
    if (create->share_with_group) {
      req.set_share_with_group(true);
      req.set_group(*create->share_with_group);
    }
    req.set_job_writable(create->job_writable);
  }
  pb::OpenBaseResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::OpenBase, req, &resp, "OpenBase"); !s.ok()) {
    return s;
  }
  OpenedBase out;
  out.created = resp.created();
  out.descriptor = resp.contents();
  out.creator_uid = resp.creator_uid();
  out.chunk_ids.assign(resp.chunk_ids().begin(), resp.chunk_ids().end());
  for (const pb::BaseChunk& c : resp.chunks()) {
    out.chunks.push_back({c.size_bytes(), static_cast<Tier>(c.home_tier())});
  }
  return out;
}

absl::Status Client::SealBase(const std::string& name, const std::string& descriptor) {
  pb::SealBaseRequest req;
  req.set_name(name);
  req.set_contents(descriptor);
  pb::SealBaseResponse resp;
  return impl_->Call(&pb::Tierd::Stub::SealBase, req, &resp, "SealBase");
}

absl::Status Client::ReleaseBase(const std::string& name) {
  pb::ReleaseBaseRequest req;
  req.set_name(name);
  pb::ReleaseBaseResponse resp;
  return impl_->Call(&pb::Tierd::Stub::ReleaseBase, req, &resp, "ReleaseBase");
}

absl::Status Client::PinBase(const std::string& name, bool pinned) {
  pb::PinBaseRequest req;
  req.set_name(name);
  req.set_pinned(pinned);
  pb::PinBaseResponse resp;
  return impl_->Call(&pb::Tierd::Stub::PinBase, req, &resp, "PinBase");
}

absl::StatusOr<std::vector<BaseStatus>> Client::ListBases() {
  pb::ListBasesRequest req;
  pb::ListBasesResponse resp;
  if (absl::Status s = impl_->Call(&pb::Tierd::Stub::ListBases, req, &resp, "ListBases"); !s.ok()) {
    return s;
  }
  std::vector<BaseStatus> out;
  for (const pb::BaseInfo& b : resp.bases()) {
    BaseStatus s;
    s.name = b.name();
    s.creator_uid = b.creator_uid();
    if (b.shared_with_group()) s.group = b.group();
    s.sealed = b.sealed();
    s.pinned = b.pinned();
    s.job = b.job();
    s.chunks = b.chunks();
    s.bytes = b.bytes();
    for (const pb::TierSpace& r : b.resident()) {
      if (r.tier() == pb::TIER_HOST) s.host_bytes = r.bytes();
      if (r.tier() == pb::TIER_NVME) s.nvme_bytes = r.bytes();
    }
    s.holders.assign(b.holders().begin(), b.holders().end());
    out.push_back(std::move(s));
  }
  return out;
}

absl::StatusOr<Client::Imported> Client::Import(ChunkId id, int fd, uint64_t file_size,
                                                int64_t file_mtime_ns,
                                                std::span<const FileRange> ranges) {
  if (ranges.empty()) return absl::InvalidArgumentError("Import: no ranges");
  Imported imported{.direct = true};
  // As many messages as the ranges need, each waited for: the daemon takes one at a time.
  for (size_t first = 0; first < ranges.size(); first += kMaxImportRanges) {
    const size_t n = std::min<size_t>(kMaxImportRanges, ranges.size() - first);
    ImportRequest request{};
    request.header = MakeHeader(SessionMessageType::kImport);
    request.count = static_cast<uint32_t>(n);
    request.chunk = id;
    request.file_size = file_size;
    request.file_mtime_ns = file_mtime_ns;
    for (size_t i = 0; i < n; ++i) {
      const FileRange& r = ranges[first + i];
      request.ranges[i] = ImportRange{r.file_offset, r.chunk_offset, r.length};
    }
    ImportReply reply{};
    {
      absl::MutexLock socket_lock(&impl_->socket_mu);
      const int sock = impl_->session_socket.get();
      if (absl::Status s =
              SendWithFds(sock, &request, kImportRequestHead + n * sizeof(ImportRange), {&fd, 1});
          !s.ok()) {
        return s;
      }
      std::vector<UniqueFd> fds;
      absl::StatusOr<size_t> got = ReceiveWithFds(sock, &reply, sizeof(reply), &fds);
      if (!got.ok()) return got.status();
      if (*got != sizeof(reply) || reply.header.magic != kSessionMagic ||
          reply.header.type != SessionMessageType::kImportReply) {
        return absl::UnavailableError("the daemon closed the session socket or sent garbage");
      }
    }
    if (reply.status_code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(reply.status_code),
          std::string(reply.message, strnlen(reply.message, sizeof(reply.message))));
    }
    imported.bytes += reply.bytes;
    imported.direct = imported.direct && reply.direct != 0;
  }
  return imported;
}

absl::StatusOr<int> Client::CudaDevice() {
  {
    absl::MutexLock lock(&impl_->segments_mu);
    if (impl_->cuda != nullptr) return impl_->cuda->ordinal();
  }
  absl::StatusOr<NodeInfo> info = GetNodeInfo();
  if (!info.ok()) return info.status();
  if (info->device_uuid.empty()) {
    return absl::NotFoundError(
        absl::StrCat("the daemon serves no device tier: ", info->device_status));
  }
  if (info->device_emulated) {
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon's device ", info->device_uuid,
                     " is emulated (host memory standing in for a GPU): there is no CUDA device "
                     "to use; device-tier pointers are host pointers and waits are host waits"));
  }
  absl::MutexLock lock(&impl_->segments_mu);
  if (absl::Status s = impl_->OpenCudaLocked(info->device_uuid); !s.ok()) return s;
  return impl_->cuda->ordinal();
}

absl::Status Client::StreamWait(CompletionToken token, uintptr_t stream) {
  // A token that is not current would pass the wait at once; say so instead.
  absl::StatusOr<SlotState> state =
      PollCompletion(*impl_->page, SlotToken{token.slot, token.sequence});
  if (!state.ok()) return state.status();
  absl::StatusOr<int> device = CudaDevice();
  if (!device.ok()) return device.status();
  absl::MutexLock lock(&impl_->segments_mu);
  if (!impl_->page_registration.registered()) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU stream waits are unavailable in this process: ", impl_->stream_wait_error,
                     "; wait on the host (Wait) instead"));
  }
  return impl_->cuda->WaitValue(stream, impl_->page_registration,
                                &impl_->page->slots[token.slot].word,
                                SlotDoneValue(token.sequence));
}

void Client::Abandon(CompletionToken token) {
  if (token.slot >= kCompletionSlots) return;
  impl_->page->slots[token.slot].acked.store(token.sequence, std::memory_order_release);
}

// --- Completion ---

Completion::Completion(Completion&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)),
      token_(other.token_),
      waited_(other.waited_) {}

Completion& Completion::operator=(Completion&& other) noexcept {
  if (this != &other) {
    if (client_ != nullptr && !waited_) client_->Abandon(token_);
    client_ = std::exchange(other.client_, nullptr);
    token_ = other.token_;
    waited_ = other.waited_;
  }
  return *this;
}

Completion::~Completion() {
  if (client_ != nullptr && !waited_) client_->Abandon(token_);
}

bool Completion::Ready() const {
  if (client_ == nullptr) return false;
  if (waited_) return true;
  return !absl::IsUnavailable(client_->Poll(token_));
}

absl::Status Completion::Wait(absl::Duration timeout) {
  if (client_ == nullptr) return absl::FailedPreconditionError("empty Completion");
  if (waited_) return absl::FailedPreconditionError("Completion already waited on");
  absl::Status s = client_->Wait(token_, timeout);
  if (!absl::IsDeadlineExceeded(s)) waited_ = true;
  return s;
}

absl::Status Completion::StreamWait(uintptr_t stream) {
  if (client_ == nullptr) return absl::FailedPreconditionError("empty Completion");
  if (waited_) return absl::OkStatus();  // completed: nothing to wait for
  return client_->StreamWait(token_, stream);
}

// --- Acquisition ---

Acquisition::Acquisition(Client* client, Acquired acquired)
    : client_(client), chunks_(std::move(acquired.chunks)), ready_(client, acquired.ready) {}

Acquisition::Acquisition(Acquisition&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)),
      chunks_(std::exchange(other.chunks_, {})),
      ready_(std::move(other.ready_)) {}

Acquisition& Acquisition::operator=(Acquisition&& other) noexcept {
  if (this != &other) {
    (void)Release();
    client_ = std::exchange(other.client_, nullptr);
    chunks_ = std::exchange(other.chunks_, {});
    ready_ = std::move(other.ready_);
  }
  return *this;
}

Acquisition::~Acquisition() { (void)Release(); }

absl::Status Acquisition::Release() {
  if (client_ == nullptr || chunks_.empty()) return absl::OkStatus();
  std::vector<ChunkId> ids;
  ids.reserve(chunks_.size());
  for (const AcquiredChunk& c : chunks_) ids.push_back(c.id);
  chunks_.clear();
  return std::exchange(client_, nullptr)->Release(ids);
}

// --- ChunkSet ---

ChunkSet& ChunkSet::operator=(ChunkSet&& other) noexcept {
  if (this != &other) {
    (void)Free();
    client_ = std::exchange(other.client_, nullptr);
    ids_ = std::exchange(other.ids_, {});
  }
  return *this;
}

ChunkSet::~ChunkSet() { (void)Free(); }

absl::Status ChunkSet::Free() {
  if (client_ == nullptr || ids_.empty()) return absl::OkStatus();
  std::vector<ChunkId> ids = std::exchange(ids_, {});
  return std::exchange(client_, nullptr)->Free(ids);
}

}  // namespace tierd
