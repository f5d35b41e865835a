// A real daemon shared with clients that misbehave on purpose — killed mid-move, writing garbage
// into their shared pages, holding connections open — and with a well-behaved tenant beside them
// whose requests must keep being served. Clients speak the raw protocol (no client library), so
// they can do what the library never would.
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/completion_page.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/daemon_process.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd {
namespace {

namespace pb = ::tierd::v1;
using testing::DaemonProcess;

std::string DaemonBinary() { return testing::ExecutableDir() + "/../daemon/tierd"; }

// A session opened with the raw protocol: its socket (the session lives while it is open), its
// credential and its mapped completion page.
struct RawSession {
  UniqueFd socket;
  std::string credential;
  CompletionPage* page = nullptr;

  RawSession() = default;
  RawSession(RawSession&& o) noexcept
      : socket(std::move(o.socket)), credential(std::move(o.credential)), page(o.page) {
    o.page = nullptr;
  }
  ~RawSession() {
    if (page != nullptr) munmap(page, kCompletionPageBytes);
  }
  // The client dies: the kernel closes its session socket.
  void Kill() { socket.Reset(); }
};

class HostileClientTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> args = {}) {
    std::vector<std::string> all = {"--host_capacity=128MiB", "--host_segment_size=16MiB",
                                    "--lock_memory=false"};
    all.insert(all.end(), args.begin(), args.end());
    auto daemon = DaemonProcess::Start({.binary = DaemonBinary(), .args = all});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    stub_ = pb::Tierd::NewStub(grpc::CreateChannel("unix:" + daemon_->socket_dir() + "/tierd.sock",
                                                   grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    stub_.reset();
    if (daemon_ != nullptr) {
      EXPECT_EQ(daemon_->StopWithin(absl::Seconds(20)), 0)
          << "tierd did not stop cleanly on SIGTERM:\n"
          << daemon_->Log();
    }
  }

  RawSession Open() {
    RawSession s;
    auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
    EXPECT_TRUE(sock.ok()) << sock.status();
    if (!sock.ok()) return s;
    HelloRequest hello{};
    hello.header = MakeHeader(SessionMessageType::kHello);
    std::strcpy(hello.client_name, "hostile");
    HelloReply reply{};
    std::vector<UniqueFd> fds;
    EXPECT_TRUE(SendWithFds(sock->get(), &hello, sizeof(hello), {}).ok());
    EXPECT_TRUE(ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds).ok());
    EXPECT_EQ(reply.status_code, 0) << reply.message;
    if (reply.status_code != 0 || fds.empty()) return s;
    void* page =
        mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
    EXPECT_NE(page, MAP_FAILED);
    s.page = page == MAP_FAILED ? nullptr : static_cast<CompletionPage*>(page);
    s.socket = std::move(*sock);
    s.credential = absl::StrCat(reply.session_id, ":", reply.token_hex);
    return s;
  }

  // A context for `session`'s call that gives up after `timeout`.
  std::unique_ptr<grpc::ClientContext> Context(const RawSession& s,
                                               absl::Duration timeout = absl::Seconds(10)) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("tierd-session", s.credential);
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    return ctx;
  }

  std::vector<uint64_t> Allocate(const RawSession& s, int n, uint64_t size) {
    pb::AllocateRequest req;
    for (int i = 0; i < n; ++i) req.add_chunks()->set_size_bytes(size);
    pb::AllocateResponse resp;
    grpc::Status status = stub_->Allocate(Context(s).get(), req, &resp);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return {resp.chunk_ids().begin(), resp.chunk_ids().end()};
  }

  // A request of the well-behaved tenant: answered promptly, whatever the others do.
  void ExpectServed(const RawSession& s, absl::Duration within = absl::Seconds(2)) {
    pb::GetNodeInfoRequest req;
    pb::GetNodeInfoResponse resp;
    const absl::Time asked = absl::Now();
    grpc::Status status = stub_->GetNodeInfo(Context(s, within).get(), req, &resp);
    EXPECT_TRUE(status.ok()) << status.error_message() << " after " << absl::Now() - asked;
  }

  uint64_t HostUsed(const RawSession& s) {
    pb::GetNodeInfoRequest req;
    pb::GetNodeInfoResponse resp;
    EXPECT_TRUE(stub_->GetNodeInfo(Context(s).get(), req, &resp).ok());
    for (const pb::TierInfo& t : resp.tiers()) {
      if (t.tier() == pb::TIER_HOST) return t.used_bytes();
    }
    return ~0ull;
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<pb::Tierd::Stub> stub_;
};

// A training job killed during prefetch: its chunks are being evicted, a Prefetch waits to bring
// them back, and the client dies. The daemon reclaims everything and goes on serving.
TEST_F(HostileClientTest, AClientKilledWhileItsChunksMoveLeavesTheDaemonServing) {
  Start();
  RawSession bystander = Open();
  for (int round = 0; round < 3; ++round) {
    RawSession victim = Open();
    const std::vector<uint64_t> ids = Allocate(victim, 6, 16 << 20);
    ASSERT_EQ(ids.size(), 6u);
    pb::EvictRequest evict;
    evict.set_tier(pb::TIER_NVME);
    pb::PrefetchRequest prefetch;
    prefetch.set_tier(pb::TIER_HOST);
    for (uint64_t id : ids) {
      evict.add_chunk_ids(id);
      prefetch.add_chunk_ids(id);
    }
    pb::EvictResponse evicted;
    ASSERT_TRUE(stub_->Evict(Context(victim).get(), evict, &evicted).ok());
    pb::PrefetchResponse prefetched;
    ASSERT_TRUE(stub_->Prefetch(Context(victim).get(), prefetch, &prefetched).ok());
    victim.Kill();  // while 96 MiB are still on their way to the drive
    ExpectServed(bystander);
    // Everything the victim held comes back once its moves have settled.
    for (absl::Time give_up = absl::Now() + absl::Seconds(20);
         HostUsed(bystander) != 0 && absl::Now() < give_up;) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_EQ(HostUsed(bystander), 0u);
  }
  EXPECT_EQ(Allocate(bystander, 1, 4096).size(), 1u);
}

// The schedule cursor is a word the client writes in its own completion page. A client that writes
// nonsense there (far ahead, backwards, at random) may confuse its own plan, nobody else's service.
TEST_F(HostileClientTest, GarbageInTheScheduleCursorFreezesNobody) {
  Start();
  RawSession bystander = Open();
  RawSession hostile = Open();
  const std::vector<uint64_t> ids = Allocate(hostile, 2, 1 << 20);
  ASSERT_EQ(ids.size(), 2u);
  pb::SetScheduleRequest schedule;
  for (uint64_t id : ids) {
    pb::StepAccess* access = schedule.add_steps()->add_accesses();
    access->set_chunk_id(id);
    access->set_tier(pb::TIER_HOST);
  }
  pb::SetScheduleResponse declared;
  ASSERT_TRUE(stub_->SetSchedule(Context(hostile).get(), schedule, &declared).ok());
  std::atomic<uint64_t>& cursor = hostile.page->header.cursor;
  cursor.store(1);
  absl::SleepFor(absl::Milliseconds(50));  // the planner has seen the iteration start
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t garbage : {uint64_t{1} << 40, uint64_t{300'000'000}, ~uint64_t{0}, uint64_t{3},
                           uint64_t{1} << 63, uint64_t{0}}) {
    cursor.store(garbage);
    absl::SleepFor(absl::Milliseconds(20));
    ExpectServed(bystander);
  }
  for (int i = 0; i < 200; ++i) {  // and at random, faster than the planner's rounds
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    cursor.store(x);
    absl::SleepFor(absl::Microseconds(500));
  }
  ExpectServed(bystander);
  ExpectServed(hostile);
}

}  // namespace
}  // namespace tierd
