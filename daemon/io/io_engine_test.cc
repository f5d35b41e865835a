// The I/O engine on real io_uring over an O_DIRECT file, with faults injected at the backend seam.
#include "daemon/io/io_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr size_t kBytes = 8 << 20;

// Every test runs on io_uring and on the thread pool that stands in for it where it is unavailable.
class IoEngineTest : public ::testing::TestWithParam<IoBackendKind> {
 protected:
  void SetUp() override {
    char path[] = "/var/tmp/tierd-engine-XXXXXX";
    int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    path_ = path;
    fd_ = open(path, O_RDWR | O_DIRECT);
    ASSERT_GE(fd_, 0) << "O_DIRECT not supported on /var/tmp";
    ASSERT_EQ(fallocate(fd_, 0, 0, kBytes), 0);
    ASSERT_EQ(posix_memalign(reinterpret_cast<void**>(&buf_), 4096, kBytes), 0);
    StartEngine({.io_size = 256 << 10, .file_names = {"region-test"}});
  }
  void StartEngine(IoEngineOptions options) {
    engine_.reset();
    std::unique_ptr<IoBackend> backend;
    if (GetParam() == IoBackendKind::kThreads) {
      backend = MakeThreadPoolBackend(std::vector<int>{fd_}, 8, 8);
    } else {
      auto uring = MakeUringBackend(std::vector<int>{fd_}, {.queue_depth = 8, .max_buffers = 4});
      ASSERT_TRUE(uring.ok()) << uring.status();
      backend = std::move(*uring);
    }
    auto faulty = std::make_unique<FaultInjectingBackend>(std::move(backend));
    faults_ = faulty.get();
    ASSERT_TRUE(faults_->RegisterBuffer(0, buf_, kBytes).ok());
    engine_ = std::make_unique<IoEngine>(std::move(faulty), std::move(options));
  }
  void TearDown() override {
    engine_.reset();
    close(fd_);
    unlink(path_.c_str());
    free(buf_);
  }

  absl::Status RunSync(std::vector<IoSpan> spans) {
    std::promise<absl::Status> p;
    engine_->Run(std::move(spans), [&](absl::Status s) { p.set_value(s); });
    return p.get_future().get();
  }
  IoSpan Span(IoKind kind, uint64_t offset, uint64_t length, int index = 0) {
    return IoSpan{kind, 0, offset, buf_ + offset, length, index};
  }
  void Fill(uint8_t seed) {
    for (size_t i = 0; i < kBytes; ++i) buf_[i] = static_cast<char>(i * 7 + seed);
  }
  bool Check(uint8_t seed) {
    for (size_t i = 0; i < kBytes; ++i) {
      if (buf_[i] != static_cast<char>(i * 7 + seed)) return false;
    }
    return true;
  }

  std::string path_;
  int fd_ = -1;
  char* buf_ = nullptr;
  FaultInjectingBackend* faults_ = nullptr;
  std::unique_ptr<IoEngine> engine_;
};

TEST_P(IoEngineTest, WritesAndReadsBackThroughRegisteredBuffers) {
  Fill(1);
  ASSERT_TRUE(RunSync({Span(IoKind::kWrite, 0, kBytes), {IoKind::kSync}}).ok());
  std::memset(buf_, 0, kBytes);
  ASSERT_TRUE(RunSync({Span(IoKind::kRead, 0, kBytes)}).ok());
  EXPECT_TRUE(Check(1));
  // 8 MiB in 256 KiB sub-I/Os: 32 writes and 32 reads.
  EXPECT_EQ(faults_->seen(IoKind::kWrite), 32u);
  EXPECT_EQ(faults_->seen(IoKind::kRead), 32u);
  EXPECT_EQ(engine_->stats().bytes_written, kBytes);
}

TEST_P(IoEngineTest, UnregisteredBuffersWorkToo) {
  Fill(2);
  ASSERT_TRUE(RunSync({Span(IoKind::kWrite, 0, kBytes, -1)}).ok());
  std::memset(buf_, 0, kBytes);
  ASSERT_TRUE(RunSync({Span(IoKind::kRead, 0, kBytes, -1)}).ok());
  EXPECT_TRUE(Check(2));
}

TEST_P(IoEngineTest, ShortTransfersAreContinued) {
  Fill(3);
  faults_->ShortenNext(IoKind::kWrite, 5);
  ASSERT_TRUE(RunSync({Span(IoKind::kWrite, 0, kBytes)}).ok());
  std::memset(buf_, 0, kBytes);
  faults_->ShortenNext(IoKind::kRead, 5);
  ASSERT_TRUE(RunSync({Span(IoKind::kRead, 0, kBytes)}).ok());
  EXPECT_TRUE(Check(3));
  EXPECT_EQ(engine_->stats().short_transfers, 10u);
}

TEST_P(IoEngineTest, ErrorFailsTheJobWithItsCauseAndLocation) {
  Fill(4);
  faults_->FailNext(IoKind::kWrite, EIO);
  absl::Status s = RunSync({Span(IoKind::kWrite, 0, kBytes)});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("write of 262144 bytes at offset 0 of region-test"), std::string::npos)
      << s;
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
  // The engine keeps serving.
  EXPECT_TRUE(RunSync({Span(IoKind::kWrite, 0, kBytes)}).ok());
}

TEST_P(IoEngineTest, NoSpaceIsReportedAsSuch) {
  faults_->FailNext(IoKind::kWrite, ENOSPC);
  absl::Status s = RunSync({Span(IoKind::kWrite, 0, 4096)});
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
}

TEST_P(IoEngineTest, ReadPastTheEndIsAnError) {
  absl::Status s =
      RunSync({Span(IoKind::kRead, 0, 4096), {IoKind::kRead, 0, kBytes, buf_, 4096, 0}});
  EXPECT_FALSE(s.ok());
}

TEST_P(IoEngineTest, SlowCompletionsStillComplete) {
  Fill(5);
  faults_->SetDelay(absl::Milliseconds(20));
  ASSERT_TRUE(RunSync({Span(IoKind::kWrite, 0, 1 << 20)}).ok());
  faults_->SetDelay(absl::ZeroDuration());
}

TEST_P(IoEngineTest, ManyConcurrentJobsAllCallBackOnce) {
  Fill(6);
  std::atomic<int> done{0};
  for (int i = 0; i < 64; ++i) {
    engine_->Run({Span(IoKind::kWrite, (i % 32) * (256 << 10), 256 << 10)}, [&](absl::Status s) {
      EXPECT_TRUE(s.ok()) << s;
      ++done;
    });
  }
  engine_->Drain();
  EXPECT_EQ(done.load(), 64);
}

// Ordering. Sub-I/Os are 256 KiB and 8 fit in the queue. A plug of 8 slow reads fills the queue
// first, so that the jobs under test are all waiting when the engine chooses among them.
constexpr uint64_t kSub = 256 << 10;
constexpr uint64_t kMiB = 1 << 20;

class IoEngineOrderTest : public IoEngineTest {
 protected:
  void Plug() {
    faults_->SetDelay(absl::Milliseconds(50));
    engine_->Run({Span(IoKind::kRead, 0, 8 * kSub)}, [](absl::Status s) { EXPECT_TRUE(s.ok()); },
                 {.flow = 99});
    while (faults_->seen(IoKind::kRead) < 8) absl::SleepFor(absl::Microseconds(100));
  }
  void Read(uint64_t offset, uint64_t length, IoOrder order) {
    engine_->Run(
        {Span(IoKind::kRead, offset, length)}, [](absl::Status s) { EXPECT_TRUE(s.ok()); }, order);
  }
  // The offsets submitted after the plug.
  std::vector<uint64_t> AfterPlug() {
    engine_->Drain();
    std::vector<uint64_t> offsets = faults_->submitted_offsets();
    EXPECT_GE(offsets.size(), 8u);
    return std::vector<uint64_t>(offsets.begin() + 8, offsets.end());
  }
};

TEST_P(IoEngineOrderTest, AJobWithAnEarlierDeadlineGoesFirst) {
  Plug();
  const absl::Time now = absl::Now();
  Read(2 * kMiB, 4 * kMiB, {.deadline = now + absl::Milliseconds(500), .flow = 1});  // 16 reads
  Read(6 * kMiB, 1 * kMiB, {.deadline = now, .flow = 1});                            // 4 reads
  const std::vector<uint64_t> order = AfterPlug();
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 4; ++i) EXPECT_GE(order[i], 6 * kMiB) << "position " << i;
  for (int i = 4; i < 20; ++i) EXPECT_LT(order[i], 6 * kMiB) << "position " << i;
}

TEST_P(IoEngineOrderTest, AJobWaitsNoLongerThanMaxWaitForLaterUrgentOnes) {
  StartEngine({.io_size = kSub, .file_names = {"region-test"}, .max_wait = absl::ZeroDuration()});
  Plug();
  Read(2 * kMiB, 1 * kMiB, {});  // background: no deadline
  absl::SleepFor(absl::Milliseconds(2));
  Read(4 * kMiB, 1 * kMiB, {.deadline = absl::Now()});
  const std::vector<uint64_t> order = AfterPlug();
  ASSERT_EQ(order.size(), 8u);
  for (int i = 0; i < 4; ++i) EXPECT_LT(order[i], 4 * kMiB) << "position " << i;
}

TEST_P(IoEngineOrderTest, AnotherFlowsUrgentBacklogDoesNotStarveThisOne) {
  Plug();
  const absl::Time now = absl::Now();
  Read(2 * kMiB, 4 * kMiB, {.deadline = now, .flow = 1});                            // 16 reads
  Read(6 * kMiB, 2 * kMiB, {.deadline = now + absl::Milliseconds(500), .flow = 2});  // 8 reads
  const std::vector<uint64_t> order = AfterPlug();
  ASSERT_EQ(order.size(), 24u);
  int second = 0;
  for (int i = 0; i < 16; ++i) second += order[i] >= 6 * kMiB;
  EXPECT_EQ(second, 8) << "equal weights: the flows alternate";
}

TEST_P(IoEngineOrderTest, FlowsShareInProportionToTheirWeights) {
  Plug();
  Read(2 * kMiB, 4 * kMiB, {.flow = 1, .weight = 3});  // 16 reads
  Read(6 * kMiB, 2 * kMiB, {.flow = 2, .weight = 1});  // 8 reads
  const std::vector<uint64_t> order = AfterPlug();
  ASSERT_EQ(order.size(), 24u);
  int first = 0;
  for (int i = 0; i < 16; ++i) first += order[i] < 6 * kMiB;
  EXPECT_GE(first, 11);
  EXPECT_LE(first, 13);
}

std::string BackendName(const ::testing::TestParamInfo<IoBackendKind>& info) {
  return info.param == IoBackendKind::kUring ? "IoUring" : "Threads";
}
INSTANTIATE_TEST_SUITE_P(Backends, IoEngineTest,
                         ::testing::Values(IoBackendKind::kUring, IoBackendKind::kThreads),
                         BackendName);
INSTANTIATE_TEST_SUITE_P(Backends, IoEngineOrderTest,
                         ::testing::Values(IoBackendKind::kUring, IoBackendKind::kThreads),
                         BackendName);

TEST(IoEngineSqpollTest, SubmissionPollingMovesTheSameBytes) {
  char path[] = "/var/tmp/tierd-sqpoll-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  fd = open(path, O_RDWR | O_DIRECT);
  ASSERT_EQ(fallocate(fd, 0, 0, 1 << 20), 0);
  char* buf = nullptr;
  ASSERT_EQ(posix_memalign(reinterpret_cast<void**>(&buf), 4096, 1 << 20), 0);
  for (int i = 0; i < (1 << 20); ++i) buf[i] = static_cast<char>(i * 13);
  {
    auto uring = MakeUringBackend(std::vector<int>{fd}, {.queue_depth = 8, .sqpoll = true});
    ASSERT_TRUE(uring.ok()) << uring.status();
    IoEngine engine(std::move(*uring), {.io_size = 64 << 10});
    std::promise<absl::Status> w;
    engine.Run({{IoKind::kWrite, 0, 0, buf, 1 << 20, -1}}, [&](absl::Status s) { w.set_value(s); });
    ASSERT_TRUE(w.get_future().get().ok());
    std::memset(buf, 0, 1 << 20);
    std::promise<absl::Status> r;
    engine.Run({{IoKind::kRead, 0, 0, buf, 1 << 20, -1}}, [&](absl::Status s) { r.set_value(s); });
    ASSERT_TRUE(r.get_future().get().ok());
  }
  for (int i = 0; i < (1 << 20); ++i) ASSERT_EQ(buf[i], static_cast<char>(i * 13)) << i;
  free(buf);
  close(fd);
  unlink(path);
}

}  // namespace
}  // namespace tierd::daemon
