// A real daemon shared with clients that misbehave on purpose — killed mid-move, writing garbage
// into their shared pages, holding connections open — and with a well-behaved tenant beside them
// whose requests must keep being served. Clients speak the raw protocol (no client library), so
// they can do what the library never would.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/completion_page.h"
#include "common/session_protocol.h"
#include "common/unix_socket.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "testing/daemon_process.h"
#include "tests/hostile_traffic.h"
#include "tierd/v1/tierd.grpc.pb.h"

namespace tierd {
namespace {

namespace pb = ::tierd::v1;
using testing::DaemonProcess;

std::string DaemonBinary() { return testing::ExecutableDir() + "/../daemon/tierd"; }

// A TOML file that lives as long as the object.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& text) {
    char tmpl[] = "/tmp/tierd-config-XXXXXX";
    const int fd = mkstemp(tmpl);
    path_ = tmpl;
    (void)!write(fd, text.data(), text.size());
    close(fd);
  }
  ~ConfigFile() { unlink(path_.c_str()); }
  std::string flag() const { return "--config=" + path_; }

 private:
  std::string path_;
};

// CPU seconds the process has used.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) {
      stime = std::stoull(field);
      break;
    }
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

size_t OpenFds(pid_t pid) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"))) {
    ++n;
  }
  return n;
}

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  return lstat(path.c_str(), &st) == 0 ? (st.st_mode & 07777) : 0;
}

// A session opened with the raw protocol: its socket (the session lives while it is open), its
// credential and its mapped completion page.
struct RawSession {
  UniqueFd socket;
  std::string credential;
  CompletionPage* page = nullptr;
  std::map<uint32_t, UniqueFd> segments;  // host segment fds, by segment

  RawSession() = default;
  RawSession(RawSession&& o) noexcept
      : socket(std::move(o.socket)),
        credential(std::move(o.credential)),
        page(o.page),
        segments(std::move(o.segments)) {
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
  void Start(std::vector<std::string> args = {}, std::vector<std::string> env = {}) {
    std::vector<std::string> all = {"--host_capacity=128MiB", "--host_segment_size=16MiB",
                                    "--lock_memory=false"};
    all.insert(all.end(), args.begin(), args.end());
    auto daemon = DaemonProcess::Start({.binary = DaemonBinary(), .args = all, .env = env});
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

  // Waits for an asynchronous request's completion token in the session's page.
  absl::Status Wait(const RawSession& s, const pb::Completion& token) {
    return WaitCompletion(*s.page, SlotToken{token.slot(), token.sequence()}, absl::Seconds(30));
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
    last_hello_ = reply;
    if (reply.status_code != 0 || fds.empty()) return s;
    void* page =
        mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(), 0);
    EXPECT_NE(page, MAP_FAILED);
    s.page = page == MAP_FAILED ? nullptr : static_cast<CompletionPage*>(page);
    for (uint32_t i = 0; i < reply.segment_count && i + 1 < fds.size(); ++i) {
      s.segments[reply.segments[i].segment] = std::move(fds[i + 1]);
    }
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

  // The host memory of an acquired location, mapped from the session's segment fd (asked for over
  // the session socket when the segment is new to it).
  char* Map(RawSession& s, const pb::ChunkLocation& loc) {
    if (!s.segments.contains(loc.segment())) {
      MapSegmentRequest req{};
      req.header = MakeHeader(SessionMessageType::kMapSegment);
      req.segment = loc.segment();
      req.tier = pb::TIER_HOST;
      MapSegmentReply reply{};
      std::vector<UniqueFd> fds;
      EXPECT_TRUE(SendWithFds(s.socket.get(), &req, sizeof(req), {}).ok());
      EXPECT_TRUE(ReceiveWithFds(s.socket.get(), &reply, sizeof(reply), &fds).ok());
      EXPECT_EQ(reply.status_code, 0) << reply.message;
      if (fds.empty()) return nullptr;
      s.segments[loc.segment()] = std::move(fds[0]);
    }
    void* base = mmap(nullptr, loc.offset() + loc.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED,
                      s.segments[loc.segment()].get(), 0);
    EXPECT_NE(base, MAP_FAILED);
    return base == MAP_FAILED ? nullptr : static_cast<char*>(base) + loc.offset();
  }
  static uint64_t Word(uint64_t seed, size_t i) { return seed * 0x9E3779B97F4A7C15ull ^ i; }

  // Opens the persistent chunk `name`, creating it if need be; 0 when the daemon refuses.
  uint64_t OpenPersistent(RawSession& s, const std::string& name, uint64_t size) {
    pb::AllocateRequest alloc;
    pb::ChunkSpec* spec = alloc.add_chunks();
    spec->set_size_bytes(size);
    spec->set_name(name);
    spec->set_persistent(true);
    spec->set_open_existing(true);
    pb::AllocateResponse allocated;
    grpc::Status st = stub_->Allocate(Context(s).get(), alloc, &allocated);
    return st.ok() && allocated.chunk_ids_size() == 1 ? allocated.chunk_ids(0) : 0;
  }

  // Creates (or opens) the persistent chunk `name`, fills it with a pattern and makes it durable.
  void WritePersistent(RawSession& s, const std::string& name, uint64_t size, uint64_t seed) {
    const uint64_t id = OpenPersistent(s, name, size);
    ASSERT_NE(id, 0u) << "cannot open " << name;
    pb::AcquireRequest acquire;
    acquire.add_chunk_ids(id);
    acquire.set_tier(pb::TIER_HOST);
    acquire.set_mode(pb::ACCESS_MODE_WRITE);
    pb::AcquireResponse acquired;
    grpc::Status st = stub_->Acquire(Context(s).get(), acquire, &acquired);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_TRUE(Wait(s, acquired.ready()).ok());
    char* data = Map(s, acquired.locations(0));
    ASSERT_NE(data, nullptr);
    for (size_t i = 0; i < size / 8; ++i) reinterpret_cast<uint64_t*>(data)[i] = Word(seed, i);
    pb::ReleaseRequest release;
    release.add_chunk_ids(id);
    pb::ReleaseResponse released;
    ASSERT_TRUE(stub_->Release(Context(s).get(), release, &released).ok());
    pb::EvictRequest evict;
    evict.add_chunk_ids(id);
    evict.set_tier(pb::TIER_NVME);
    pb::EvictResponse evicted;
    ASSERT_TRUE(stub_->Evict(Context(s).get(), evict, &evicted).ok());
    ASSERT_TRUE(Wait(s, evicted.completion()).ok());
  }

  // True when the persistent chunk `name` exists and holds the pattern of `seed`.
  bool ReadsBack(RawSession& s, const std::string& name, uint64_t size, uint64_t seed) {
    const uint64_t id = OpenPersistent(s, name, size);
    if (id == 0) return false;
    pb::AcquireRequest acquire;
    acquire.add_chunk_ids(id);
    acquire.set_tier(pb::TIER_HOST);
    acquire.set_mode(pb::ACCESS_MODE_READ);
    pb::AcquireResponse acquired;
    if (!stub_->Acquire(Context(s).get(), acquire, &acquired).ok()) return false;
    if (absl::Status ready = Wait(s, acquired.ready()); !ready.ok()) {
      ADD_FAILURE() << ready;
      return false;
    }
    const char* data = Map(s, acquired.locations(0));
    bool same = data != nullptr;
    for (size_t i = 0; same && i < size / 8; ++i) {
      same = reinterpret_cast<const uint64_t*>(data)[i] == Word(seed, i);
    }
    pb::ReleaseRequest release;
    release.add_chunk_ids(id);
    pb::ReleaseResponse released;
    EXPECT_TRUE(stub_->Release(Context(s).get(), release, &released).ok());
    return same;
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
  HelloReply last_hello_{};
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

// Out of file descriptors, the session socket's listener stays readable; accepting nothing, the
// daemon spun on it and logged every failure (32 MB/s). Now it sheds the new connections and logs
// a few lines, and serves again as soon as descriptors are free.
TEST_F(HostileClientTest, RunningOutOfFileDescriptorsNeitherSpinsNorFloodsTheLog) {
  // In the sanitized build, UBSan proves a virtual call's object readable by writing its vtable
  // into a pipe; with no descriptor free the pipe fails, and every call whose type the check has
  // not cached is reported as an "invalid vptr" (inside gRPC's handlers, where it was seen). This
  // daemon runs out of descriptors on purpose, so its vptr check is off; the rest of the suite
  // keeps it.
  const std::string suppressions = ::testing::TempDir() + "/tierd-out-of-fds.supp";
  absl::Cleanup remove_file = [&suppressions] { std::remove(suppressions.c_str()); };
  std::ofstream(suppressions) << "vptr:*\n";  // by source file: an invalid vptr has no type name
  Start({}, {"UBSAN_OPTIONS=print_stacktrace=1:suppressions=" + suppressions});
  RawSession bystander = Open();
  ExpectServed(bystander);  // its gRPC connection is open before the descriptors run out
  const pid_t pid = daemon_->pid();
  rlimit limit{};
  limit.rlim_cur = limit.rlim_max = OpenFds(pid) + 12;
  ASSERT_EQ(prlimit(pid, RLIMIT_NOFILE, &limit, nullptr), 0) << std::strerror(errno);
  std::vector<UniqueFd> idle;
  for (int i = 0; i < 64; ++i) {
    auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
    if (sock.ok()) idle.push_back(std::move(*sock));
  }
  const size_t log_before = daemon_->Log().size();
  const double cpu_before = CpuSeconds(pid);
  absl::SleepFor(absl::Seconds(1));
  EXPECT_LT(CpuSeconds(pid) - cpu_before, 0.2);
  EXPECT_LT(daemon_->Log().size() - log_before, 4096u) << daemon_->Log().substr(log_before, 2000);
  EXPECT_NE(daemon_->Log().find("out of file descriptors"), std::string::npos);
  ExpectServed(bystander);  // its connection was open before
  idle.clear();
  absl::SleepFor(absl::Milliseconds(100));
  RawSession late = Open();
  EXPECT_FALSE(late.credential.empty());
  ExpectServed(late);
}

// A hello's job field is the client's bytes: one without a terminating NUL or with characters a
// label cannot hold is refused with the reason; a hello without the field (a client older than
// it) opens a session with no job. The daemon serves on.
TEST_F(HostileClientTest, HelloJobLabelsAreCheckedAndOlderHellosStillWork) {
  Start();
  auto hello = [&](const HelloRequest& request, size_t bytes) {
    auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
    EXPECT_TRUE(sock.ok()) << sock.status();
    HelloReply reply{};
    std::vector<UniqueFd> fds;
    EXPECT_TRUE(SendWithFds(sock->get(), &request, bytes, {}).ok());
    EXPECT_TRUE(ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds).ok());
    return reply;
  };
  HelloRequest request{};
  request.header = MakeHeader(SessionMessageType::kHello);
  std::memset(request.job, 'j', sizeof(request.job));  // no NUL: 64 bytes
  HelloReply reply = hello(request, sizeof(request));
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(std::string(reply.message).find("job label of 64 bytes"), std::string::npos)
      << reply.message;
  std::memset(request.job, 0, sizeof(request.job));
  std::strcpy(request.job, "a\x7f{b=\"c\"}");
  reply = hello(request, sizeof(request));
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
  std::strcpy(request.job, "old-client-never-sends-this");
  reply = hello(request, kHelloRequestWithoutJob);
  EXPECT_EQ(reply.status_code, 0) << reply.message;
  EXPECT_NE(reply.session_id, 0u);
  ExpectServed(Open());
}

// Imports as the raw protocol lets a client send them: the wrong length, no fd or two, what is not
// a file, a chunk it does not hold, a file that is not the one whose layout it read. Each is
// refused on the session's socket, which goes on serving; then a good one reads the file's bytes
// into the chunk, and a client killed while its imports run leaves the daemon serving.
TEST_F(HostileClientTest, MalformedImportsAreRefusedAndTheSessionGoesOn) {
  Start();
  RawSession s = Open();
  const uint64_t chunk = Allocate(s, 1, 1 << 20)[0];
  const std::string path = daemon_->socket_dir() + "/weights.bin";
  std::string content(3 << 20, '\0');
  for (size_t i = 0; i < content.size(); ++i) content[i] = static_cast<char>(i * 13 + (i >> 10));
  std::ofstream(path, std::ios::binary) << content;
  UniqueFd file(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  struct stat st {};
  ASSERT_EQ(fstat(file.get(), &st), 0);
  ImportRequest req{};
  req.header = MakeHeader(SessionMessageType::kImport);
  req.chunk = chunk;
  req.file_size = static_cast<uint64_t>(st.st_size);
  req.file_mtime_ns = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
  req.count = 1;
  req.ranges[0] = ImportRange{.file_offset = 4097, .chunk_offset = 0, .length = 1 << 20};
  const size_t good_size = kImportRequestHead + sizeof(ImportRange);
  auto send = [&](const ImportRequest& r, size_t size, const std::vector<int>& fds) {
    EXPECT_TRUE(SendWithFds(s.socket.get(), &r, size, fds).ok());
    ImportReply reply{};
    std::vector<UniqueFd> back;
    auto n = ReceiveWithFds(s.socket.get(), &reply, sizeof(reply), &back);
    EXPECT_TRUE(n.ok() && *n == sizeof(reply));
    return static_cast<absl::StatusCode>(reply.status_code);
  };
  using absl::StatusCode;
  EXPECT_EQ(send(req, good_size + 8, {file.get()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(send(req, good_size, {}), StatusCode::kInvalidArgument);
  EXPECT_EQ(send(req, good_size, {file.get(), file.get()}), StatusCode::kInvalidArgument);
  ImportRequest many = req;
  many.count = kMaxImportRanges + 1;
  EXPECT_EQ(send(many, good_size, {file.get()}), StatusCode::kInvalidArgument);
  UniqueFd dir(open(daemon_->socket_dir().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  EXPECT_EQ(send(req, good_size, {dir.get()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(send(req, good_size, {file.get()}), StatusCode::kFailedPrecondition);  // not held
  // The chunk acquired for writing in the host tier, as an import needs it.
  auto hold = [&](const RawSession& session, uint64_t id) {
    pb::AcquireRequest acquire;
    acquire.add_chunk_ids(id);
    acquire.set_tier(pb::TIER_HOST);
    acquire.set_mode(pb::ACCESS_MODE_OVERWRITE);
    pb::AcquireResponse acquired;
    EXPECT_TRUE(stub_->Acquire(Context(session).get(), acquire, &acquired).ok());
    return acquired;
  };
  const pb::AcquireResponse acquired = hold(s, chunk);
  ASSERT_EQ(acquired.locations_size(), 1);
  ImportRequest stale = req;
  stale.file_mtime_ns += 1;
  EXPECT_EQ(send(stale, good_size, {file.get()}), StatusCode::kFailedPrecondition);
  ImportRequest past_end = req;
  past_end.ranges[0].file_offset = (3 << 20) - 10;
  EXPECT_EQ(send(past_end, good_size, {file.get()}), StatusCode::kInvalidArgument);
  // Still served, and a good import reads the file's bytes into the chunk.
  ExpectServed(s);
  ASSERT_EQ(send(req, good_size, {file.get()}), StatusCode::kOk);
  const char* at = Map(s, acquired.locations(0));
  ASSERT_NE(at, nullptr);
  EXPECT_EQ(std::memcmp(at, content.data() + 4097, 1 << 20), 0);

  // A client that dies with its imports under way (its socket closes, as the kernel closes it
  // when the process is killed): the daemon serves the others.
  for (int round = 0; round < 20; ++round) {
    RawSession k = Open();
    const uint64_t c = Allocate(k, 1, 1 << 20)[0];
    hold(k, c);
    ImportRequest mine = req;
    mine.chunk = c;
    const int fd = file.get();
    for (int i = 0; i < 3; ++i) (void)SendWithFds(k.socket.get(), &mine, good_size, {&fd, 1});
    if (round % 2 == 1) absl::SleepFor(absl::Microseconds(200 * round));
  }
  RawSession other = Open();
  ExpectServed(other);
}

// One user cannot take every connection or session of the node.
TEST_F(HostileClientTest, ConnectionsAndSessionsPerUserAreLimited) {
  ConfigFile config("[limits]\nconnections_per_uid = 6\nsessions_per_uid = 3\n");
  Start({config.flag()});
  std::vector<RawSession> sessions;
  for (int i = 0; i < 3; ++i) sessions.push_back(Open());
  // The fourth session is refused, naming the limit; its connection was the fourth.
  auto sock = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
  ASSERT_TRUE(sock.ok());
  HelloRequest hello{};
  hello.header = MakeHeader(SessionMessageType::kHello);
  HelloReply reply{};
  std::vector<UniqueFd> fds;
  ASSERT_TRUE(SendWithFds(sock->get(), &hello, sizeof(hello), {}).ok());
  ASSERT_TRUE(ReceiveWithFds(sock->get(), &reply, sizeof(reply), &fds).ok());
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kResourceExhausted));
  EXPECT_NE(std::string(reply.message).find("limits.sessions_per_uid"), std::string::npos)
      << reply.message;
  // Two more connections fit; the seventh is closed at once.
  std::vector<UniqueFd> extra;
  for (int i = 0; i < 3; ++i) {
    auto c = ConnectSeqpacket(daemon_->socket_dir() + "/tierd.session.sock");
    ASSERT_TRUE(c.ok());
    extra.push_back(std::move(*c));
  }
  char byte;
  EXPECT_EQ(*ReceiveWithFds(extra.back().get(), &byte, 1, nullptr), 0u);  // closed by the daemon
  EXPECT_NE(daemon_->Log().find("limits.connections_per_uid"), std::string::npos);
  // Closing a session makes room for another.
  sessions.pop_back();
  absl::SleepFor(absl::Milliseconds(100));
  sock->Reset();
  extra.clear();
  absl::SleepFor(absl::Milliseconds(100));
  RawSession again = Open();
  ExpectServed(again);
}

// Two daemons given one state directory, or one region, destroyed each other's persistent chunks.
// The state directory and every region are locked; the second daemon is refused and the first
// keeps serving its data.
TEST_F(HostileClientTest, ASecondDaemonOnTheSameStateOrRegionIsRefused) {
  Start();
  RawSession s = Open();
  WritePersistent(s, "job/weights", 1 << 20, 7);
  const std::string dir = daemon_->socket_dir();
  char other[] = "/tmp/tierd-second-XXXXXX";
  ASSERT_NE(mkdtemp(other), nullptr);
  const std::vector<std::string> common = {"--host_capacity=16MiB", "--host_segment_size=16MiB",
                                           "--lock_memory=false", "--probe_bytes=0",
                                           "--metrics_listen=none"};
  auto run = [&](std::vector<std::string> args, std::string* out) {
    args.insert(args.begin(), DaemonBinary());
    args.insert(args.end(), common.begin(), common.end());
    return testing::RunProcess(args, out);
  };
  std::string out;
  // Its own sockets, the first one's state directory (and so its region).
  EXPECT_EQ(run({absl::StrCat("--socket_dir=", other, "/run"), "--state_dir=" + dir + "/state",
                 "--nvme_regions=" + dir + "/nvme0.region:256MiB"},
                &out),
            2)
      << out;
  EXPECT_NE(out.find(absl::StrCat("is in use by another tierd (pid ", daemon_->pid(), ")")),
            std::string::npos)
      << out;
  // Its own state directory, the first one's region.
  EXPECT_EQ(run({absl::StrCat("--socket_dir=", other, "/run"),
                 absl::StrCat("--state_dir=", other, "/state"),
                 "--nvme_regions=" + dir + "/nvme0.region:256MiB"},
                &out),
            1)
      << out;
  EXPECT_NE(out.find("nvme0.region' is in use by another process"), std::string::npos) << out;
  // One region named twice (a second path to the same file).
  const std::string alias = absl::StrCat(other, "/alias.region");
  ASSERT_EQ(symlink((absl::StrCat(other, "/r0")).c_str(), alias.c_str()), 0);
  EXPECT_EQ(run({absl::StrCat("--socket_dir=", other, "/run2"),
                 absl::StrCat("--state_dir=", other, "/state2"),
                 absl::StrCat("--nvme_regions=", other, "/r0:256MiB,", alias, ":256MiB")},
                &out),
            1)
      << out;
  EXPECT_NE(out.find("are the same file or device"), std::string::npos) << out;
  EXPECT_TRUE(ReadsBack(s, "job/weights", 1 << 20, 7));
  std::filesystem::remove_all(other);
}

// A region file that went missing, or came back empty, was formatted anew: the instance's
// persistent chunks vanished and opening them by name handed out fresh zeroed chunks. The daemon
// now refuses, naming the fix, and serves the data again once the region is back.
TEST_F(HostileClientTest, AMissingOrBlankRegionOfAFormattedSetIsRefusedNotFormattedAnew) {
  Start();
  const std::string region = daemon_->socket_dir() + "/nvme0.region";
  {
    RawSession s = Open();
    WritePersistent(s, "job/state", 1 << 20, 9);
  }
  stub_.reset();
  ASSERT_EQ(daemon_->Stop(), 0);
  ASSERT_EQ(rename(region.c_str(), (region + ".away").c_str()), 0);
  absl::Status restarted = daemon_->Restart();
  ASSERT_FALSE(restarted.ok());
  EXPECT_NE(restarted.message().find("nvme0.region' is missing"), std::string::npos) << restarted;
  EXPECT_NE(restarted.message().find("--nvme_reformat"), std::string::npos) << restarted;
  EXPECT_FALSE(std::filesystem::exists(region));  // not created anew
  // Empty, as a restore that failed halfway leaves it.
  { std::ofstream(region).flush(); }
  restarted = daemon_->Restart();
  ASSERT_FALSE(restarted.ok());
  EXPECT_NE(restarted.message().find("the NVMe regions are blank"), std::string::npos) << restarted;
  ASSERT_EQ(rename((region + ".away").c_str(), region.c_str()), 0);
  ASSERT_TRUE(daemon_->Restart().ok());
  stub_ = pb::Tierd::NewStub(grpc::CreateChannel("unix:" + daemon_->socket_dir() + "/tierd.sock",
                                                 grpc::InsecureChannelCredentials()));
  RawSession s = Open();
  EXPECT_TRUE(ReadsBack(s, "job/state", 1 << 20, 9));
}

// The daemon set the sockets' modes and group by name after binding them: a socket-group member who
// could write to the socket directory swapped a socket for a symlink in between and made the
// daemon chmod (and chown) any file it pointed at. The daemon now sets them where nobody else can
// write and renames the finished sockets into place; an attacker racing on the public names
// changes nothing.
TEST(SocketDirectoryTest, SwappingASocketForASymlinkChangesNoOtherFile) {
  char tmpl[] = "/tmp/tierd-swap-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  chmod(dir.c_str(), 0755);
  const std::string victim = dir + "/victim";
  { std::ofstream(victim) << "root's secret\n"; }
  chmod(victim.c_str(), 0600);
  std::atomic<bool> stop{false};
  std::thread attacker([&] {
    int i = 0;
    while (!stop.load()) {
      for (const char* name : {"tierd.sock", "tierd.session.sock"}) {
        const std::string link = absl::StrCat(dir, "/.link", i++);
        if (symlink(victim.c_str(), link.c_str()) == 0) {
          rename(link.c_str(), (dir + "/" + name).c_str());
        }
      }
    }
  });
  for (int round = 0; round < 5 && ModeOf(victim) == 0600; ++round) {
    pid_t pid = -1;
    int out = -1;
    ASSERT_TRUE(testing::StartProcess(
        {DaemonBinary(), "--socket_dir=" + dir, "--state_dir=" + dir + "/state",
         "--nvme_regions=none", "--host_capacity=16MiB", "--host_segment_size=16MiB",
         "--lock_memory=false", "--probe_bytes=0", "--metrics_listen=none",
         "--socket_group=nogroup"},
        &pid, &out));
    absl::SleepFor(absl::Milliseconds(300));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    close(out);
  }
  stop.store(true);
  attacker.join();
  struct stat st {};
  ASSERT_EQ(stat(victim.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_gid, 0u);
  std::filesystem::remove_all(dir);
}

// Whatever umask the daemon is started with, what it creates is writable by nobody else.
TEST(SocketDirectoryTest, FilesAndDirectoriesGetTheirModesWhateverTheUmask) {
  char tmpl[] = "/tmp/tierd-umask-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  chmod(tmpl, 0755);
  const std::string dir = tmpl;
  const mode_t old = umask(0);
  pid_t pid = -1;
  int out = -1;
  const bool started = testing::StartProcess(
      {DaemonBinary(), "--socket_dir=" + dir + "/run", "--state_dir=" + dir + "/state",
       "--nvme_regions=" + dir + "/state/r0:256MiB", "--host_capacity=16MiB",
       "--host_segment_size=16MiB", "--lock_memory=false", "--probe_bytes=0",
       "--metrics_listen=none"},
      &pid, &out);
  umask(old);
  ASSERT_TRUE(started);
  // The sockets appear whole (renamed into place), once the daemon serves.
  for (absl::Time give_up = absl::Now() + absl::Seconds(30);
       !std::filesystem::exists(dir + "/run/tierd.sock") && absl::Now() < give_up;) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(ModeOf(dir + "/run"), 0755u);
  EXPECT_EQ(ModeOf(dir + "/run/tierd.sock"), 0660u);
  EXPECT_EQ(ModeOf(dir + "/run/tierd.session.sock"), 0660u);
  EXPECT_EQ(ModeOf(dir + "/state"), 0750u);
  EXPECT_EQ(ModeOf(dir + "/state/instance_id"), 0644u);
  EXPECT_EQ(ModeOf(dir + "/state/r0"), 0600u);
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_socket()) continue;  // the socket group's to write to
    EXPECT_EQ(ModeOf(e.path()) & (S_IWGRP | S_IWOTH), 0u) << e.path();
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  close(out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::filesystem::remove_all(dir);
}

TEST(SocketDirectoryTest, ADirectoryOthersCanWriteIntoIsRefused) {
  char tmpl[] = "/tmp/tierd-open-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  for (auto [mode, who] : {std::pair{0770, "its group"}, std::pair{0777, "everyone"}}) {
    chmod(dir.c_str(), mode);
    for (const char* flag : {"--socket_dir=", "--state_dir="}) {
      std::string out;
      EXPECT_EQ(testing::RunProcess(
                    {DaemonBinary(), flag + dir, "--nvme_regions=none", "--host_capacity=16MiB",
                     "--host_segment_size=16MiB", "--lock_memory=false"},
                    &out),
                2)
          << out;
      EXPECT_NE(out.find(absl::StrCat("is writable by ", who)), std::string::npos) << out;
    }
  }
  std::filesystem::remove_all(dir);
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
constexpr bool kSanitized = __has_feature(address_sanitizer);
#else
constexpr bool kSanitized = false;
#endif

// Rounds of hostile traffic (hostile_traffic.h: structured, mutated, random, oversized and forged
// requests from clients that die): every tier's bytes in use stay the space its chunks take, and
// the daemon's resident set levels off. It grew by hundreds of MiB before: glibc kept the memory
// the largest requests' parses freed in each of its arenas (docs/benchmarks/daemon.md).
// The daemon's resident set (or another line of its /proc status, `field`) once what it gives
// back has gone back: memory is trimmed at most every 2 s after requests, by a thread of its own
// that a loaded machine runs late, so the set is read until it has not fallen for a second (after
// at least 4 s, at most 20 s).
uint64_t SettledRss(pid_t pid, std::string_view field = "VmRSS") {
  const absl::Time start = absl::Now();
  uint64_t last = testing::StatusBytes(pid, field);
  int level = 0;  // readings in a row that did not fall
  for (;;) {
    absl::SleepFor(absl::Milliseconds(500));
    const uint64_t now = testing::StatusBytes(pid, field);
    level = now + (1 << 20) < last ? 0 : level + 1;
    last = now;
    const absl::Duration waited = absl::Now() - start;
    if ((level >= 2 && waited >= absl::Seconds(4)) || waited >= absl::Seconds(20)) return now;
  }
}

TEST(HostileTrafficTest, RoundsOfItLeaveTheResidentSetLevelAndEveryTierAccounted) {
  auto daemon = DaemonProcess::Start(
      {.binary = DaemonBinary(),
       .args = {"--host_capacity=128MiB", "--host_segment_size=16MiB", "--lock_memory=false",
                "--device=emulated", "--device_capacity=32MiB", "--device_segment_size=16MiB",
                "--probe_bytes=0", "--log_level=warn"}});
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const std::string& dir = (*daemon)->socket_dir();
  const uint64_t start = testing::RssBytes((*daemon)->pid());
  std::vector<uint64_t> rss;
  std::string rounds;  // what each round left resident, for a failure's message
  // Sanitized, only the accounting is checked (see below), on less traffic: its parses are slow.
  for (uint64_t round = 1; round <= (kSanitized ? 2 : 4); ++round) {
    auto sent = testing::SendHostileTraffic(
        {.socket_dir = dir, .seed = round, .requests = kSanitized ? 200u : 600u});
    ASSERT_TRUE(sent.ok()) << sent.status() << "\n" << (*daemon)->Log();
    auto a = testing::SettledAccounting(dir);
    ASSERT_TRUE(a.ok()) << a.status();
    for (int t = 1; t < 4; ++t) {
      EXPECT_EQ(a->used_bytes[t], a->copies_bytes[t]) << "tier " << t << ", round " << round;
    }
    ASSERT_TRUE(testing::FreeEverything(dir).ok());
    rss.push_back(SettledRss((*daemon)->pid()));
    absl::StrAppend(&rounds, " round ", round, ": ", rss.back() >> 20, " MiB (anonymous ",
                    testing::StatusBytes((*daemon)->pid(), "RssAnon") >> 20, ", shared ",
                    testing::StatusBytes((*daemon)->pid(), "RssShmem") >> 20, ");");
  }
  EXPECT_EQ((*daemon)->StopWithin(absl::Seconds(20)), 0) << (*daemon)->Log();
  // AddressSanitizer's allocator keeps what is freed in its quarantine: the resident set says
  // nothing of glibc's arenas there.
  if (kSanitized) return;
  const auto mib = [](uint64_t b) { return static_cast<double>(b) / (1 << 20); };
  EXPECT_LT(mib(*std::max_element(rss.begin(), rss.end())) - mib(start), 64)
      << "from " << mib(start) << " MiB:" << rounds;
  EXPECT_LT(mib(rss[3]) - mib(rss[0]), 16) << "from " << mib(start) << " MiB:" << rounds;
}

// A chunk takes a few hundred bytes in the daemon and under ten in a request: a hundred thousand
// of them came and went in requests well under the MiB that made the daemon trim, and a session's
// end, which frees its scratch chunks, made it trim not at all. The tens of MiB they left in
// glibc's arenas stayed resident until some large request came along; under hostile traffic that
// was 13-33 MiB after some rounds. Every request's end and every session's end count now. And
// what joined an arena's top through glibc's fastbins stayed even after a trim (23 MiB, one run in
// three on a loaded machine): the daemon runs without fastbins.
TEST_F(HostileClientTest, MemoryThatSmallRequestsOrAnEndingSessionFreeGoesBackToTheKernel) {
  if (kSanitized) GTEST_SKIP() << "AddressSanitizer's quarantine keeps what is freed resident";
  Start({"--host_capacity=512MiB"});  // room for the chunks' space (shared memory, not counted)
  const auto anon_mib = [&] {
    return static_cast<double>(SettledRss(daemon_->pid(), "RssAnon")) / (1 << 20);
  };
  const double before = anon_mib();
  // Returns the chunks' ids, and checks they took memory worth giving back.
  const auto allocate = [&](const RawSession& s) {
    pb::AllocateRequest allocate;
    for (int i = 0; i < 100'000; ++i) allocate.add_chunks()->set_size_bytes(4096);
    EXPECT_LT(allocate.ByteSizeLong(), 1u << 20);
    pb::AllocateResponse allocated;
    grpc::Status status = stub_->Allocate(Context(s).get(), allocate, &allocated);
    EXPECT_TRUE(status.ok()) << status.error_message();
    const double holding = anon_mib();
    EXPECT_GT(holding - before, 16) << "100,000 chunks from " << before << " MiB";
    return allocated.chunk_ids();
  };
  {
    RawSession s = Open();
    pb::FreeRequest free;
    *free.mutable_chunk_ids() = allocate(s);
    EXPECT_LT(free.ByteSizeLong(), 1u << 20);
    pb::FreeResponse freed;
    grpc::Status status = stub_->Free(Context(s).get(), free, &freed);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_LT(anon_mib() - before, 4) << "freed by a request, from " << before << " MiB";
  }  // the session ends with nothing to free
  RawSession s = Open();
  allocate(s);
  s.Kill();  // its scratch chunks are freed
  EXPECT_LT(anon_mib() - before, 4) << "freed at a session's end, from " << before << " MiB";
}

}  // namespace
}  // namespace tierd
