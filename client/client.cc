// Client: the session with the daemon (connect, and the end of the session when the client is
// destroyed), its chunks (allocate, acquire, prefetch, evict, free) and their completions, and the
// handles that let them go (Completion, Acquisition, ChunkSet). The node and schedules are in
// client_node.cc, shared bases and imports in client_bases.cc; the session they share is
// client_impl.h.
#include "tierd/client.hpp"

#include <cstdlib>

#include "client/client_impl.h"

namespace tierd {

using client_internal::AddIds;
using client_internal::FromProto;
using client_internal::Mapping;
using client_internal::ToProto;

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

absl::Status Client::Discard(std::span<const ChunkId> ids) {
  pb::DiscardRequest req;
  AddIds(req.mutable_chunk_ids(), ids);
  pb::DiscardResponse resp;
  return impl_->Call(&pb::Tierd::Stub::Discard, req, &resp, "Discard");
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
