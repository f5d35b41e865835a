#include "daemon/api/rpc_server.h"

#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fmt_absl.h"
#include "common/wire.h"
#include "daemon/api/health_service.h"
#include "daemon/api/node_info.h"
#include "daemon/api/request_interceptor.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd::daemon {
namespace {

namespace pb = ::tierd::v1;

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::StatusOr<TierKind> FromProto(pb::Tier tier, bool allow_unspecified = true) {
  if (tier == pb::TIER_UNSPECIFIED && allow_unspecified) return TierKind::kHost;
  if (std::optional<TierKind> t = TierFromWire(tier)) return *t;
  return absl::InvalidArgumentError(absl::StrCat("unknown tier ", static_cast<int>(tier)));
}

void ToProto(const ChunkMeta& c, pb::ChunkInfo* out) {
  out->set_chunk_id(c.id);
  out->set_size_bytes(c.size);
  out->set_name(c.name);
  out->set_persistent(c.persistent);
  for (const std::string& tag : c.tags) out->add_tags(tag);
  out->set_home_tier(ToProto(c.home));
  for (TierKind t : kAllTiers) {
    if (c.resident.contains(t)) out->add_resident_tiers(ToProto(t));
    if (c.dirty.contains(t)) out->add_dirty_tiers(ToProto(t));
    if (c.allocated.contains(t)) {
      pb::TierSpace* space = out->add_space();
      space->set_tier(ToProto(t));
      space->set_bytes(c.placement[t].size);
    }
  }
  out->set_state(c.state == ChunkState::kMoving ? pb::CHUNK_STATE_MOVING : pb::CHUNK_STATE_READY);
  out->set_pins(c.pins);
  out->set_owner_session(c.owner);
  out->set_lost(c.lost);
  out->set_transient(c.transient);
}

void ToProto(SlotToken token, pb::Completion* out) {
  out->set_slot(token.slot);
  out->set_sequence(token.sequence);
}

template <typename Ids>
std::span<const ChunkId> Span(const Ids& ids) {
  return {ids.data(), static_cast<size_t>(ids.size())};
}

class TierdService final : public pb::Tierd::Service {
 public:
  explicit TierdService(RpcServerDeps deps) : deps_(std::move(deps)), started_(absl::Now()) {}

  grpc::Status Allocate(grpc::ServerContext* ctx, const pb::AllocateRequest* req,
                        pb::AllocateResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    std::vector<ChunkRequest> requests;
    requests.reserve(req->chunks_size());
    for (int i = 0; i < req->chunks_size(); ++i) {
      const pb::ChunkSpec& spec = req->chunks(i);
      absl::StatusOr<TierKind> home = FromProto(spec.home_tier());
      if (!home.ok()) {
        return ToGrpc(absl::InvalidArgumentError(
            absl::StrCat("Allocate, chunk #", i, ": ", home.status().message())));
      }
      requests.push_back(ChunkRequest{spec.size_bytes(),
                                      *home,
                                      spec.name(),
                                      spec.persistent(),
                                      {spec.tags().begin(), spec.tags().end()},
                                      spec.open_existing(),
                                      spec.must_exist(),
                                      spec.shared(),
                                      spec.transient()});
    }
    absl::StatusOr<std::vector<ChunkId>> ids = deps_.chunks->Allocate(**session, requests);
    if (!ids.ok()) return ToGrpc(ids.status());
    resp->mutable_chunk_ids()->Add(ids->begin(), ids->end());
    return grpc::Status::OK;
  }

  grpc::Status Free(grpc::ServerContext* ctx, const pb::FreeRequest* req,
                    pb::FreeResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->Free(**session, Span(req->chunk_ids())));
  }

  grpc::Status Prefetch(grpc::ServerContext* ctx, const pb::PrefetchRequest* req,
                        pb::PrefetchResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    absl::StatusOr<TierKind> tier = FromProto(req->tier(), /*allow_unspecified=*/false);
    if (!tier.ok()) return ToGrpc(tier.status());
    absl::StatusOr<SlotToken> token =
        deps_.chunks->Prefetch(**session, Span(req->chunk_ids()), *tier, req->priority());
    if (!token.ok()) return ToGrpc(token.status());
    ToProto(*token, resp->mutable_completion());
    return grpc::Status::OK;
  }

  grpc::Status Evict(grpc::ServerContext* ctx, const pb::EvictRequest* req,
                     pb::EvictResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    absl::StatusOr<TierKind> tier = FromProto(req->tier(), /*allow_unspecified=*/false);
    if (!tier.ok()) return ToGrpc(tier.status());
    absl::StatusOr<SlotToken> token =
        deps_.chunks->Evict(**session, Span(req->chunk_ids()), *tier, req->keep_source());
    if (!token.ok()) return ToGrpc(token.status());
    ToProto(*token, resp->mutable_completion());
    return grpc::Status::OK;
  }

  grpc::Status Discard(grpc::ServerContext* ctx, const pb::DiscardRequest* req,
                       pb::DiscardResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->Discard(**session, Span(req->chunk_ids())));
  }

  grpc::Status Acquire(grpc::ServerContext* ctx, const pb::AcquireRequest* req,
                       pb::AcquireResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    absl::StatusOr<TierKind> tier = FromProto(req->tier());
    if (!tier.ok()) return ToGrpc(tier.status());
    Access access;
    switch (req->mode()) {
      case pb::ACCESS_MODE_READ:
        access = Access::kRead;
        break;
      case pb::ACCESS_MODE_WRITE:
        access = Access::kWrite;
        break;
      case pb::ACCESS_MODE_OVERWRITE:
        access = Access::kOverwrite;
        break;
      default:
        return ToGrpc(absl::InvalidArgumentError(
            absl::StrCat("Acquire: access mode ", static_cast<int>(req->mode()),
                         " is not ACCESS_MODE_READ, ACCESS_MODE_WRITE or ACCESS_MODE_OVERWRITE")));
    }
    // Waiting for room lasts no longer than the caller waits for the answer.
    absl::StatusOr<AcquireResult> result = deps_.chunks->Acquire(
        **session, Span(req->chunk_ids()), *tier, access, absl::FromChrono(ctx->deadline()));
    if (!result.ok()) return ToGrpc(result.status());
    resp->mutable_locations()->Reserve(req->chunk_ids_size());
    for (int i = 0; i < req->chunk_ids_size(); ++i) {
      const Placement& p = result->locations[i];
      pb::ChunkLocation* loc = resp->add_locations();
      loc->set_chunk_id(req->chunk_ids(i));
      loc->set_tier(ToProto(p.tier));
      loc->set_size_bytes(p.size);
      loc->set_segment(p.segment);
      loc->set_segment_generation(p.generation);
      loc->set_offset(p.offset);
    }
    ToProto(result->ready, resp->mutable_ready());
    return grpc::Status::OK;
  }

  grpc::Status SetSchedule(grpc::ServerContext* ctx, const pb::SetScheduleRequest* req,
                           pb::SetScheduleResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    ScheduleRequest schedule;
    schedule.steps.reserve(req->steps_size());
    uint64_t accesses = 0;
    for (const pb::ScheduleStep& step : req->steps()) {
      std::vector<ScheduledAccess>& out = schedule.steps.emplace_back();
      out.reserve(step.accesses_size());
      for (const pb::StepAccess& a : step.accesses()) {
        absl::StatusOr<TierKind> tier = FromProto(a.tier());
        if (!tier.ok()) return ToGrpc(tier.status());
        Access access = Access::kRead;
        if (a.mode() == pb::ACCESS_MODE_WRITE) {
          access = Access::kWrite;
        } else if (a.mode() == pb::ACCESS_MODE_OVERWRITE) {
          access = Access::kOverwrite;
        } else if (a.mode() != pb::ACCESS_MODE_READ && a.mode() != pb::ACCESS_MODE_UNSPECIFIED) {
          return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
              "SetSchedule: access mode ", static_cast<int>(a.mode()), " of chunk ", a.chunk_id(),
              " is not ACCESS_MODE_READ, ACCESS_MODE_WRITE or ACCESS_MODE_OVERWRITE")));
        }
        out.push_back({.id = a.chunk_id(),
                       .tier = *tier,
                       .access = access,
                       .other = a.other_chunk_id(),
                       .version_bit = a.version_bit()});
        ++accesses;
      }
    }
    schedule.quota[TierKind::kHost] = req->host_quota_bytes();
    schedule.quota[TierKind::kDevice] = req->device_quota_bytes();
    schedule.trace_steps = req->trace_steps();
    const uint32_t steps = static_cast<uint32_t>(schedule.steps.size());
    if (absl::Status s = deps_.chunks->SetSchedule(**session, std::move(schedule)); !s.ok()) {
      return ToGrpc(s);
    }
    resp->set_steps(steps);
    resp->set_accesses(accesses);
    return grpc::Status::OK;
  }

  grpc::Status GetSessionStats(grpc::ServerContext* ctx, const pb::GetSessionStatsRequest*,
                               pb::GetSessionStatsResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    const SessionStats stats = deps_.chunks->session_stats(**session);
    resp->set_acquired_ready(stats.ready);
    resp->set_acquired_waited(stats.waited);
    for (TierKind t : {TierKind::kHost, TierKind::kDevice}) {
      pb::TierStall* stall = resp->add_stalls();
      stall->set_tier(ToProto(t));
      stall->set_stall_seconds(absl::ToDoubleSeconds(stats.stall[t]));
    }
    resp->set_planner_fetches(stats.planner_fetches);
    resp->set_planner_drops(stats.planner_drops);
    resp->set_planner_write_backs(stats.planner_write_backs);
    resp->set_cursor(stats.cursor);
    resp->set_schedule_steps(stats.schedule_steps);
    resp->set_tracing(stats.tracing);
    resp->set_bandwidth_weight(stats.bandwidth_weight);
    return grpc::Status::OK;
  }

  grpc::Status SetBandwidthWeight(grpc::ServerContext* ctx,
                                  const pb::SetBandwidthWeightRequest* req,
                                  pb::SetBandwidthWeightResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->SetBandwidthWeight(**session, req->weight()));
  }

  grpc::Status Drain(grpc::ServerContext* ctx, const pb::DrainRequest* req,
                     pb::DrainResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    absl::StatusOr<TierKind> tier = FromProto(req->tier(), /*allow_unspecified=*/false);
    if (!tier.ok()) return ToGrpc(tier.status());
    absl::StatusOr<DrainResult> r = deps_.chunks->Drain(**session, *tier, Span(req->chunk_ids()));
    if (!r.ok()) return ToGrpc(r.status());
    ToProto(r->token, resp->mutable_completion());
    resp->set_chunks(r->chunks);
    resp->set_bytes(r->bytes);
    resp->set_pinned_chunks(r->pinned);
    return grpc::Status::OK;
  }

  grpc::Status OpenBase(grpc::ServerContext* ctx, const pb::OpenBaseRequest* req,
                        pb::OpenBaseResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    std::optional<BaseRequest> create;
    if (req->create()) {
      create.emplace();
      if (static_cast<size_t>(req->chunks_size()) > kMaxBaseChunks) {
        return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
            "OpenBase: ", req->chunks_size(), " chunks; a base has at most ", kMaxBaseChunks)));
      }
      for (const pb::BaseChunk& c : req->chunks()) {
        absl::StatusOr<TierKind> home = FromProto(c.home_tier());
        if (!home.ok()) return ToGrpc(home.status());
        create->sizes.push_back(c.size_bytes());
        create->homes.push_back(*home);
      }
      create->descriptor = req->contents();
      if (req->share_with_group()) create->group = req->group();
      create->job_writable = req->job_writable();
    }
    absl::StatusOr<OpenedBase> base =
        deps_.chunks->OpenBase(**session, req->name(), create ? &*create : nullptr);
    if (!base.ok()) return ToGrpc(base.status());
    resp->set_created(base->created);
    resp->set_contents(base->descriptor);
    resp->set_creator_uid(base->creator);
    for (size_t i = 0; i < base->chunks.size(); ++i) {
      resp->add_chunk_ids(base->chunks[i]);
      pb::BaseChunk* c = resp->add_chunks();
      c->set_size_bytes(base->sizes[i]);
      c->set_home_tier(ToProto(base->homes[i]));
    }
    return grpc::Status::OK;
  }

  grpc::Status SealBase(grpc::ServerContext* ctx, const pb::SealBaseRequest* req,
                        pb::SealBaseResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->SealBase(**session, req->name(), req->contents()));
  }

  grpc::Status ReleaseBase(grpc::ServerContext* ctx, const pb::ReleaseBaseRequest* req,
                           pb::ReleaseBaseResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->ReleaseBase(**session, req->name()));
  }

  grpc::Status PinBase(grpc::ServerContext* ctx, const pb::PinBaseRequest* req,
                       pb::PinBaseResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->PinBase(**session, req->name(), req->pinned()));
  }

  grpc::Status ListBases(grpc::ServerContext* ctx, const pb::ListBasesRequest*,
                         pb::ListBasesResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    for (const BaseStatus& b : deps_.chunks->ListBases(**session)) {
      pb::BaseInfo* out = resp->add_bases();
      out->set_name(b.name);
      out->set_creator_uid(b.creator);
      out->set_shared_with_group(b.group.has_value());
      out->set_group(b.group.value_or(0));
      out->set_sealed(b.sealed);
      out->set_job(b.job);
      out->set_pinned(b.pinned);
      out->set_chunks(b.chunks);
      out->set_bytes(b.bytes);
      for (TierKind t : kAllTiers) {
        if (b.resident_bytes[t] == 0) continue;
        pb::TierSpace* r = out->add_resident();
        r->set_tier(ToProto(t));
        r->set_bytes(b.resident_bytes[t]);
      }
      for (const std::string& h : b.holders) out->add_holders(h);
    }
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext* ctx, const pb::ReleaseRequest* req,
                       pb::ReleaseResponse*) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    return ToGrpc(deps_.chunks->Release(**session, Span(req->chunk_ids())));
  }

  grpc::Status Stat(grpc::ServerContext* ctx, const pb::StatRequest* req,
                    pb::StatResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    absl::StatusOr<std::vector<ChunkMeta>> chunks =
        deps_.chunks->Stat(**session, Span(req->chunk_ids()));
    if (!chunks.ok()) return ToGrpc(chunks.status());
    for (const ChunkMeta& c : *chunks) ToProto(c, resp->add_chunks());
    return grpc::Status::OK;
  }

  grpc::Status ListChunks(grpc::ServerContext* ctx, const pb::ListChunksRequest* req,
                          pb::ListChunksResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    if (req->page_size() > kMaxPageSize) {
      return ToGrpc(absl::InvalidArgumentError(
          absl::StrCat("ListChunks: page_size ", req->page_size(), " exceeds ", kMaxPageSize)));
    }
    ChunkPage page;
    if (req->all_sessions()) {
      absl::StatusOr<ChunkPage> all =
          deps_.chunks->ListAll(**session, req->page_token(), req->page_size());
      if (!all.ok()) return ToGrpc(all.status());
      page = std::move(*all);
    } else {
      page = deps_.chunks->List(**session, req->page_token(), req->page_size());
    }
    for (const ChunkMeta& c : page.chunks) {
      pb::ChunkInfo* info = resp->add_chunks();
      ToProto(c, info);
      if (auto it = page.bases.find(c.base); it != page.bases.end()) info->set_base(it->second);
    }
    resp->set_next_page_token(page.next_page_token);
    return grpc::Status::OK;
  }

  grpc::Status GetNodeInfo(grpc::ServerContext* ctx, const pb::GetNodeInfoRequest* req,
                           pb::GetNodeInfoResponse* resp) override {
    auto session = Authenticate(ctx);
    if (!session.ok()) return ToGrpc(session.status());
    ReportNode(deps_, **session, req->list_sessions(), started_, resp);
    return grpc::Status::OK;
  }

 private:
  absl::StatusOr<std::shared_ptr<Session>> Authenticate(grpc::ServerContext* ctx) const {
    const auto& metadata = ctx->client_metadata();
    auto it = metadata.find(kSessionMetadataKey);
    if (it == metadata.end()) {
      return absl::PermissionDeniedError(
          absl::StrCat("no session credential: send '<id>:<token>' from the session socket in "
                       "the '",
                       kSessionMetadataKey, "' metadata"));
    }
    return deps_.sessions->Authenticate(absl::string_view(it->second.data(), it->second.size()));
  }

  RpcServerDeps deps_;
  absl::Time started_;
};

}  // namespace

struct RpcServer::Impl {
  std::unique_ptr<TierdService> service;
  HealthService health{std::string(RpcServer::kServiceName)};
  std::unique_ptr<grpc::Server> server;
};

absl::StatusOr<std::unique_ptr<RpcServer>> RpcServer::Start(const std::string& path,
                                                            RpcServerDeps deps) {
  RpcMetrics* metrics = deps.metrics;
  MemoryTrimmer* trimmer = deps.trimmer;
  auto impl = std::make_unique<Impl>();
  impl->service = std::make_unique<TierdService>(std::move(deps));
  // Beside the API, the standard services tools speak: grpc.health.v1.Health (grpc_health_probe,
  // Kubernetes-style probes) and server reflection (grpcurl and the like; a process-wide switch,
  // read when a server is built).
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("unix:", path), grpc::InsecureServerCredentials());
  builder.RegisterService(impl->service.get());
  builder.RegisterService(&impl->health);
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(kMaxReplyBytes);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(
      std::make_unique<RequestInterceptorFactory>(metrics, trimmer, RpcServer::kServiceName));
  builder.experimental().SetInterceptorCreators(std::move(creators));
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve gRPC on unix:", path, " (is the directory writable?)"));
  }
  return std::unique_ptr<RpcServer>(new RpcServer(std::move(impl)));
}

RpcServer::RpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RpcServer::~RpcServer() { Shutdown(absl::Seconds(5)); }

void RpcServer::SetServing(bool serving) { impl_->health.SetServing(serving); }

void RpcServer::Shutdown(absl::Duration grace) {
  if (impl_->server == nullptr) return;
  // NOT_SERVING for good, sent to every watcher (whose calls then end), before calls are refused.
  impl_->health.Stop();
  impl_->server->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  impl_->server->Wait();
  impl_->server.reset();
}

}  // namespace tierd::daemon
