#include "tests/hostile_traffic.h"

#include <unistd.h>

#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/session_protocol.h"
#include "common/unique_fd.h"
#include "common/unix_socket.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd::testing {
namespace {

namespace pb = ::tierd::v1;

constexpr const char* kMethods[] = {
    "Allocate", "Free",       "Prefetch",    "Evict",       "Acquire",         "Release",
    "Stat",     "ListChunks", "GetNodeInfo", "SetSchedule", "GetSessionStats", "SetBandwidthWeight",
    "Drain",    "Discard"};
constexpr int kMethodCount = sizeof(kMethods) / sizeof(kMethods[0]);
constexpr const char* kKinds[] = {"structured", "mutated", "random", "oversized", "forged"};

struct Session {
  UniqueFd socket;  // the session lives while it is open
  std::string credential;
};

absl::StatusOr<Session> OpenSession(const std::string& socket_dir, const char* name) {
  absl::StatusOr<UniqueFd> sock = ConnectSeqpacket(socket_dir + "/tierd.session.sock");
  if (!sock.ok()) return sock.status();
  HelloRequest hello{};
  hello.header = MakeHeader(SessionMessageType::kHello);
  std::strncpy(hello.client_name, name, sizeof(hello.client_name) - 1);
  if (absl::Status s = SendWithFds(sock->get(), &hello, sizeof(hello), {}); !s.ok()) return s;
  HelloReply reply{};
  std::vector<UniqueFd> fds;  // the completion page and segments: not needed here
  if (absl::StatusOr<size_t> n = ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds);
      !n.ok()) {
    return n.status();
  }
  if (reply.status_code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.status_code), reply.message);
  }
  return Session{std::move(*sock), absl::StrCat(reply.session_id, ":", reply.token_hex)};
}

std::unique_ptr<grpc::GenericStub> Stub(const std::string& socket_dir) {
  return std::make_unique<grpc::GenericStub>(grpc::CreateChannel(
      "unix:" + socket_dir + "/tierd.sock", grpc::InsecureChannelCredentials()));
}

grpc::Status Call(grpc::GenericStub& stub, const std::string& credential, const std::string& method,
                  const std::string& body, std::string* response) {
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1), reply;
  grpc::ClientContext ctx;
  ctx.AddMetadata("tierd-session", credential);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, absl::StrCat("/tierd.v1.Tierd/", method), grpc::StubOptions(), &request,
                 &reply, [&](grpc::Status s) { done.set_value(s); });
  grpc::Status status = done.get_future().get();
  std::vector<grpc::Slice> slices;
  if (status.ok() && response != nullptr && reply.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      response->append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  return status;
}

// The requests of one traffic, from its seed.
class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }
  bool Coin(int one_in = 2) { return Below(one_in) == 0; }

  // A chunk id: mostly this session's, sometimes another's or made up.
  uint64_t Id(const std::vector<uint64_t>& mine) {
    if (!mine.empty() && !Coin(5)) return mine[Below(mine.size())];
    return Coin() ? Below(64) : rng_();
  }
  int Tier() { return static_cast<int>(Below(6)); }  // the three tiers, unknown ones too

  // What a header value may hold (gRPC refuses to send anything else).
  std::string Printable(size_t most) {
    std::string s(Below(most + 1), 'a');
    for (char& c : s) c = static_cast<char>(' ' + Below(95));
    return s;
  }

  std::string Text(size_t most) {
    std::string s(Below(most + 1), 'a');
    for (char& c : s) c = static_cast<char>(Coin(4) ? Below(256) : 'a' + Below(26));
    return s;
  }

  // A valid message of `method` with plausible and implausible fields.
  std::string Structured(int method, const std::vector<uint64_t>& mine) {
    auto ids = [&](auto* r) {
      for (uint64_t n = 1 + Below(6); n > 0; --n) r->add_chunk_ids(Id(mine));
    };
    std::string out;
    switch (method) {
      case 0: {
        pb::AllocateRequest r;
        for (uint64_t n = 1 + Below(6); n > 0; --n) {
          pb::ChunkSpec* c = r.add_chunks();
          c->set_size_bytes(Coin(8) ? rng_() : (uint64_t{4096} << Below(12)) - Below(3));
          c->set_home_tier(static_cast<pb::Tier>(Tier()));
          if (Coin(3)) c->set_name(Coin() ? absl::StrCat("hostile/", Below(16)) : Text(80));
          c->set_persistent(Coin(3));
          if (Coin(4)) c->add_tags(Text(16));
          c->set_open_existing(Coin(3));
          c->set_must_exist(Coin(5));
          c->set_shared(Coin(5));
          c->set_transient(Coin(4));
        }
        r.SerializeToString(&out);
        break;
      }
      case 1: {
        pb::FreeRequest r;
        ids(&r);
        r.SerializeToString(&out);
        break;
      }
      case 2: {
        pb::PrefetchRequest r;
        ids(&r);
        r.set_tier(static_cast<pb::Tier>(Tier()));
        r.set_priority(static_cast<int32_t>(rng_()));
        r.SerializeToString(&out);
        break;
      }
      case 3: {
        pb::EvictRequest r;
        ids(&r);
        r.set_tier(static_cast<pb::Tier>(Tier()));
        r.set_keep_source(Coin());
        r.SerializeToString(&out);
        break;
      }
      case 4: {
        pb::AcquireRequest r;
        ids(&r);
        r.set_tier(static_cast<pb::Tier>(Tier()));
        r.set_mode(static_cast<pb::AccessMode>(Below(5)));
        r.SerializeToString(&out);
        break;
      }
      case 5: {
        pb::ReleaseRequest r;
        ids(&r);
        r.SerializeToString(&out);
        break;
      }
      case 6: {
        pb::StatRequest r;
        ids(&r);
        r.SerializeToString(&out);
        break;
      }
      case 7: {
        pb::ListChunksRequest r;
        r.set_page_size(static_cast<uint32_t>(Coin() ? Below(200000) : rng_()));
        r.set_page_token(Coin() ? 0 : rng_());
        r.set_all_sessions(Coin());
        r.SerializeToString(&out);
        break;
      }
      case 8: {
        pb::GetNodeInfoRequest r;
        r.set_list_sessions(Coin());
        r.SerializeToString(&out);
        break;
      }
      case 9: {
        pb::SetScheduleRequest r;
        if (Coin(4)) r.set_trace_steps(static_cast<uint32_t>(Coin() ? Below(100) : rng_()));
        if (Coin(4)) r.set_host_quota_bytes(rng_());
        for (uint64_t n = Below(40); n > 0; --n) {
          pb::ScheduleStep* step = r.add_steps();
          for (uint64_t k = Below(4); k > 0; --k) {
            pb::StepAccess* a = step->add_accesses();
            a->set_chunk_id(Id(mine));
            a->set_tier(static_cast<pb::Tier>(Tier()));
            a->set_mode(static_cast<pb::AccessMode>(Below(5)));
          }
        }
        r.SerializeToString(&out);
        break;
      }
      case 11: {
        pb::SetBandwidthWeightRequest r;
        r.set_weight(static_cast<uint32_t>(Coin() ? Below(100) : rng_()));
        r.SerializeToString(&out);
        break;
      }
      case 12: {
        pb::DrainRequest r;
        r.set_tier(static_cast<pb::Tier>(Tier()));
        if (Coin()) ids(&r);
        r.SerializeToString(&out);
        break;
      }
      case 13: {
        pb::DiscardRequest r;
        ids(&r);
        r.SerializeToString(&out);
        break;
      }
      default:
        break;  // GetSessionStats: an empty message
    }
    return out;
  }

  std::string Mutated(std::string s) {
    for (uint64_t n = 1 + Below(8); n > 0 && !s.empty(); --n) {
      switch (Below(4)) {
        case 0:
          s[Below(s.size())] ^= static_cast<char>(1 << Below(8));
          break;
        case 1:
          s.resize(Below(s.size()));
          break;
        case 2:
          s.insert(Below(s.size() + 1), s.substr(0, Below(s.size() + 1)));
          break;
        default:
          s[Below(s.size())] = static_cast<char>(rng_());
          break;
      }
    }
    return s;
  }

  // Near and past the default 4 MiB message limit: many chunks, long names, long id lists.
  std::string Oversized(int* method, const std::vector<uint64_t>& mine) {
    std::string out;
    switch (Below(4)) {
      case 0: {
        *method = 0;
        pb::AllocateRequest r;
        for (uint64_t n = 10000 + Below(100000); n > 0; --n) {
          r.add_chunks()->set_size_bytes(4096 + Below(1 << 20));
        }
        r.SerializeToString(&out);
        break;
      }
      case 1: {
        *method = 0;
        pb::AllocateRequest r;
        pb::ChunkSpec* c = r.add_chunks();
        c->set_size_bytes(4096);
        c->set_name(std::string(1 + Below(5 << 20), 'n'));
        c->set_persistent(true);
        for (int i = 0; i < 64; ++i) c->add_tags(std::string(4096, 't'));
        r.SerializeToString(&out);
        break;
      }
      case 2: {
        *method = 9;
        pb::SetScheduleRequest r;
        for (uint64_t n = 50000 + Below(200000); n > 0; --n) {
          r.add_steps()->add_accesses()->set_chunk_id(Id(mine));
        }
        r.SerializeToString(&out);
        break;
      }
      default: {
        *method = static_cast<int>(Below(kMethodCount));
        pb::StatRequest r;
        for (uint64_t n = 100000 + Below(600000); n > 0; --n) r.add_chunk_ids(Id(mine));
        r.SerializeToString(&out);
        break;
      }
    }
    return out;
  }

 private:
  std::mt19937_64 rng_;
};

}  // namespace

absl::StatusOr<HostileTrafficReport> SendHostileTraffic(const HostileTrafficOptions& o) {
  // Strings that are not UTF-8 are sent on purpose: not worth a log line each.
  google::protobuf::SetLogHandler(nullptr);
  Generator gen(o.seed);
  HostileTrafficReport report;
  std::unique_ptr<grpc::GenericStub> stub = Stub(o.socket_dir);
  std::string dead_credential = "1:00";
  while (report.requests < o.requests) {
    absl::StatusOr<Session> session = OpenSession(o.socket_dir, "hostile-traffic");
    if (!session.ok()) return session.status();
    ++report.sessions;
    std::vector<uint64_t> mine;
    for (uint32_t i = 0; i < o.per_session && report.requests < o.requests; ++i) {
      int method = static_cast<int>(gen.Below(kMethodCount));
      const int kind = static_cast<int>(gen.Below(5));
      std::string body;
      std::string credential = session->credential;
      switch (kind) {
        case 0:
          body = gen.Structured(method, mine);
          break;
        case 1:
          body = gen.Mutated(gen.Structured(method, mine));
          break;
        case 2:
          body = gen.Text(2048);
          break;
        case 3:
          body = gen.Oversized(&method, mine);
          break;
        default:
          body = gen.Structured(method, mine);
          // Another session's id with a made-up token, a dead session's credential, or garbage.
          credential =
              gen.Coin(3) ? dead_credential
              : gen.Coin()
                  ? absl::StrCat(session->credential.substr(0, session->credential.find(':')), ":",
                                 gen.Printable(32))
                  : gen.Printable(64);
          break;
      }
      ++report.by_kind[kKinds[kind]];
      ++report.requests;
      std::string response;
      grpc::Status s = Call(*stub, credential, kMethods[method], body, &response);
      ++report.by_code[s.error_code()];
      if (s.error_code() == grpc::StatusCode::INTERNAL ||
          s.error_code() == grpc::StatusCode::UNKNOWN) {
        return absl::InternalError(absl::StrCat(kMethods[method], " (", kKinds[kind], ") answered ",
                                                s.error_code(), ": ", s.error_message()));
      }
      if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
        return absl::UnavailableError(
            absl::StrCat("the daemon stopped answering: ", s.error_message()));
      }
      if (s.ok() && method == 0) {
        pb::AllocateResponse allocated;
        if (allocated.ParseFromString(response)) {
          for (uint64_t id : allocated.chunk_ids()) mine.push_back(id);
        }
      }
    }
    dead_credential = session->credential;
    // The client dies.
  }
  return report;
}

absl::StatusOr<TierAccounting> AccountTiers(const std::string& socket_dir) {
  absl::StatusOr<Session> session = OpenSession(socket_dir, "accounting");
  if (!session.ok()) return session.status();
  auto stub = pb::Tierd::NewStub(grpc::CreateChannel("unix:" + socket_dir + "/tierd.sock",
                                                     grpc::InsecureChannelCredentials()));
  auto context = [&] {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("tierd-session", session->credential);
    return ctx;
  };
  TierAccounting a;
  pb::GetNodeInfoRequest info_req;
  pb::GetNodeInfoResponse info;
  if (grpc::Status s = stub->GetNodeInfo(context().get(), info_req, &info); !s.ok()) {
    return absl::UnavailableError(s.error_message());
  }
  for (const pb::TierInfo& t : info.tiers()) {
    if (t.tier() > 0 && t.tier() < 4) a.used_bytes[t.tier()] = t.used_bytes();
  }
  uint64_t token = 0;
  do {
    pb::ListChunksRequest req;
    req.set_all_sessions(true);
    req.set_page_size(100000);
    req.set_page_token(token);
    pb::ListChunksResponse page;
    if (grpc::Status s = stub->ListChunks(context().get(), req, &page); !s.ok()) {
      return absl::UnavailableError(s.error_message());
    }
    for (const pb::ChunkInfo& c : page.chunks()) {
      ++a.chunks;
      for (const pb::TierSpace& space : c.space()) {
        if (space.tier() > 0 && space.tier() < 4) a.copies_bytes[space.tier()] += space.bytes();
      }
    }
    token = page.next_page_token();
  } while (token != 0);
  return a;
}

absl::StatusOr<TierAccounting> SettledAccounting(const std::string& dir) {
  absl::StatusOr<TierAccounting> last = AccountTiers(dir);
  for (int i = 0; i < 200 && last.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    absl::StatusOr<TierAccounting> now = AccountTiers(dir);
    if (!now.ok()) return now;
    bool same = now->chunks == last->chunks;
    for (int t = 1; t < 4; ++t) {
      same = same && now->used_bytes[t] == last->used_bytes[t] &&
             now->copies_bytes[t] == last->copies_bytes[t];
    }
    if (same) return now;
    last = now;
  }
  return last;
}

absl::Status FreeEverything(const std::string& socket_dir) {
  absl::StatusOr<Session> session = OpenSession(socket_dir, "cleaner");
  if (!session.ok()) return session.status();
  auto stub = pb::Tierd::NewStub(grpc::CreateChannel("unix:" + socket_dir + "/tierd.sock",
                                                     grpc::InsecureChannelCredentials()));
  for (absl::Time give_up = absl::Now() + absl::Seconds(30);;) {
    grpc::ClientContext list_ctx;
    list_ctx.AddMetadata("tierd-session", session->credential);
    pb::ListChunksRequest req;
    req.set_all_sessions(true);
    req.set_page_size(100000);
    pb::ListChunksResponse page;
    if (grpc::Status s = stub->ListChunks(&list_ctx, req, &page); !s.ok()) {
      return absl::UnavailableError(s.error_message());
    }
    if (page.chunks().empty()) return absl::OkStatus();
    pb::FreeRequest free;
    for (const pb::ChunkInfo& c : page.chunks()) {
      if (c.persistent() || c.owner_session() == 0) free.add_chunk_ids(c.chunk_id());
    }
    if (free.chunk_ids_size() > 0) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("tierd-session", session->credential);
      pb::FreeResponse freed;
      (void)stub->Free(&ctx, free, &freed);  // one still moving is freed on the next round
    }
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat(page.chunks_size(), " chunks still on the node after 30 s"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace tierd::testing
