// The gRPC API as any client sees it on the wire, without the client library: credentials and
// values the library would never send.
#include <future>
#include "absl/strings/str_cat.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"

#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "testing/daemon_process.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd {
namespace {

class ApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto daemon = testing::DaemonProcess::Start(
        {.binary = testing::ExecutableDir() + "/../daemon/tierd",
         .args = {"--host_capacity=16MiB", "--host_segment_size=16MiB", "--lock_memory=false"}});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    stub_ = v1::Tierd::NewStub(grpc::CreateChannel("unix:" + daemon_->socket_dir() + "/tierd.sock",
                                                   grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    // Drop our channel first: the daemon's shutdown waits (up to its 5 s grace) for clients that
    // keep an idle connection open without polling it.
    stub_.reset();
    if (daemon_) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
    }
  }

  // Opens a session with the raw protocol; the socket must stay open for the session to live.
  std::string OpenSession() {
    auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
    EXPECT_TRUE(sock.ok());
    HelloRequest hello{};
    hello.header = MakeHeader(SessionMessageType::kHello);
    HelloReply reply{};
    std::vector<UniqueFd> fds;
    EXPECT_TRUE(SendWithFds(sock->get(), &hello, sizeof(hello), {}).ok());
    EXPECT_TRUE(ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds).ok());
    EXPECT_EQ(reply.status_code, 0);
    session_socket_ = std::move(*sock);
    return absl::StrCat(reply.session_id, ":", reply.token_hex);
  }

  grpc::Status Allocate(const std::string& credential, const v1::AllocateRequest& req,
                        v1::AllocateResponse* resp) {
    grpc::ClientContext ctx;
    if (!credential.empty()) ctx.AddMetadata("tierd-session", credential);
    return stub_->Allocate(&ctx, req, resp);
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<v1::Tierd::Stub> stub_;
  UniqueFd session_socket_;
};

TEST_F(ApiTest, CallsWithoutAValidSessionCredentialArePermissionDenied) {
  v1::AllocateRequest req;
  req.add_chunks()->set_size_bytes(4096);
  const std::string good = OpenSession();
  const std::string wrong_token =
      good.substr(0, good.find(':') + 1) + std::string(2 * kSessionTokenBytes, 'a');
  for (const std::string& credential :
       {std::string(), std::string("garbage"), std::string("1:00"), wrong_token}) {
    v1::AllocateResponse resp;
    grpc::Status s = Allocate(credential, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << "'" << credential << "'";
  }
  v1::AllocateResponse resp;
  EXPECT_TRUE(Allocate(good, req, &resp).ok());
}

TEST_F(ApiTest, CredentialDiesWithItsSessionSocket) {
  const std::string credential = OpenSession();
  session_socket_.Reset();  // the client goes away
  v1::AllocateRequest req;
  req.add_chunks()->set_size_bytes(4096);
  grpc::Status s;
  for (int i = 0; i < 100; ++i) {  // the daemon notices the hang-up asynchronously
    v1::AllocateResponse resp;
    s = Allocate(credential, req, &resp);
    if (s.error_code() == grpc::StatusCode::PERMISSION_DENIED) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
}

TEST_F(ApiTest, UnknownEnumValuesOnTheWireAreInvalidArgument) {
  const std::string credential = OpenSession();
  v1::AllocateRequest req;
  v1::ChunkSpec* spec = req.add_chunks();
  spec->set_size_bytes(4096);
  spec->set_home_tier(static_cast<v1::Tier>(42));
  v1::AllocateResponse resp;
  grpc::Status s = Allocate(credential, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("unknown tier 42"), std::string::npos) << s.error_message();

  grpc::ClientContext ctx;
  ctx.AddMetadata("tierd-session", credential);
  v1::ListChunksRequest list;
  list.set_page_size(1'000'000);
  v1::ListChunksResponse listed;
  EXPECT_EQ(stub_->ListChunks(&ctx, list, &listed).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// A persistent chunk takes at least the NVMe tier's persistent granule there (GetNodeInfo says
// how much): ListChunks says so, and each tier's bytes in use are the space its chunks take.
TEST_F(ApiTest, ListChunksSaysTheSpaceEachCopyTakesAndTheTiersAddUp) {
  const std::string credential = OpenSession();
  v1::AllocateRequest req;
  for (int i = 0; i < 3; ++i) {
    v1::ChunkSpec* spec = req.add_chunks();
    spec->set_size_bytes(i == 2 ? 1 << 20 : 4096);
    spec->set_home_tier(v1::TIER_NVME);
    spec->set_name(absl::StrCat("space/", i));
    spec->set_persistent(i < 2);
  }
  v1::AllocateResponse resp;
  ASSERT_TRUE(Allocate(credential, req, &resp).ok());
  auto call = [&] {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("tierd-session", credential);
    return ctx;
  };
  v1::ListChunksRequest list;
  list.set_all_sessions(true);
  v1::ListChunksResponse listed;
  ASSERT_TRUE(stub_->ListChunks(call().get(), list, &listed).ok());
  ASSERT_EQ(listed.chunks_size(), 3);
  v1::GetNodeInfoRequest info_req;
  v1::GetNodeInfoResponse info;
  ASSERT_TRUE(stub_->GetNodeInfo(call().get(), info_req, &info).ok());
  uint64_t granule = 0;
  for (const v1::TierInfo& t : info.tiers()) {
    if (t.tier() == v1::TIER_NVME) granule = t.persistent_granule_bytes();
  }
  ASSERT_GT(granule, 4096u);
  uint64_t nvme_space = 0;
  for (const v1::ChunkInfo& c : listed.chunks()) {
    ASSERT_EQ(c.space_size(), 1) << c.ShortDebugString();
    EXPECT_EQ(c.space(0).tier(), v1::TIER_NVME);
    // The small persistent chunks take the granule; the scratch one its size.
    EXPECT_EQ(c.space(0).bytes(), c.persistent() ? granule : c.size_bytes()) << c.name();
    nvme_space += c.space(0).bytes();
  }
  for (const v1::TierInfo& t : info.tiers()) {
    EXPECT_EQ(t.used_bytes(), t.tier() == v1::TIER_NVME ? nvme_space : 0u) << t.tier();
  }
}

// Bytes that are not a request message are the client's error, not the daemon's.
TEST_F(ApiTest, UnparseableRequestsAreInvalidArgument) {
  const std::string credential = OpenSession();
  grpc::GenericStub generic(grpc::CreateChannel("unix:" + daemon_->socket_dir() + "/tierd.sock",
                                                grpc::InsecureChannelCredentials()));
  for (const char* method : {"/tierd.v1.Tierd/Allocate", "/tierd.v1.Tierd/Acquire"}) {
    const std::string junk("\xff\xff\xff\xff\x0f", 5);  // field 0 of an unknown wire type
    grpc::Slice slice(junk);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    ctx.AddMetadata("tierd-session", credential);
    std::promise<grpc::Status> done;
    generic.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) { done.set_value(s); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << s.error_message();
    EXPECT_NE(s.error_message().find("is not a valid tierd.v1."), std::string::npos)
        << s.error_message();
  }
  v1::AllocateRequest req;
  req.add_chunks()->set_size_bytes(4096);
  v1::AllocateResponse resp;
  EXPECT_TRUE(Allocate(credential, req, &resp).ok());  // the daemon still serves
}

TEST_F(ApiTest, MalformedSessionSocketMessagesCloseTheConnectionAndNothingElse) {
  auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
  ASSERT_TRUE(sock.ok());
  const char junk[] = "not a hello";
  ASSERT_TRUE(SendWithFds(sock->get(), junk, sizeof(junk), {}).ok());
  char buf[64];
  EXPECT_EQ(*ReceiveWithFds(sock->get(), buf, sizeof(buf), nullptr), 0u);  // closed by daemon
  EXPECT_FALSE(OpenSession().empty());  // the daemon still serves
}

}  // namespace
}  // namespace tierd
