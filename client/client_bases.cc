// Client's calls about shared bases (docs/streaming.md, "One copy per node") and imports of a
// file's byte ranges into a chunk by the daemon (docs/sessions.md).
#include "client/client_impl.h"

namespace tierd {

using client_internal::ToProto;

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

}  // namespace tierd
