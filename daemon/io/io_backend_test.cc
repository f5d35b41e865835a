// The backends on their own, each over a real file: io_uring and the thread pool do the same
// positional reads, writes and syncs and report a transfer past the end as short; the
// fault-injecting wrapper fails and shortens what it is told to. The engine above them
// is io_engine_test's.
#include "daemon/io/io_backend.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

enum class Kind { kUring, kThreads };

class IoBackendTest : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    char path[] = "/tmp/tierd-io-backend-XXXXXX";
    fd_ = mkstemp(path);
    ASSERT_GE(fd_, 0);
    unlink(path);
    ASSERT_EQ(ftruncate(fd_, kFileBytes), 0);
    const int fds[] = {fd_};
    if (GetParam() == Kind::kUring) {
      absl::StatusOr<std::unique_ptr<IoBackend>> uring =
          MakeUringBackend(fds, UringOptions{.queue_depth = 8});
      if (!uring.ok()) GTEST_SKIP() << "io_uring is not available here: " << uring.status();
      backend_ = std::move(*uring);
    } else {
      backend_ = MakeThreadPoolBackend(fds, 8, 2);
    }
  }
  void TearDown() override {
    backend_.reset();
    if (fd_ >= 0) close(fd_);
  }

  // Submits one request and waits for its completion's result.
  int32_t Do(IoKind kind, uint64_t offset, char* buffer, uint32_t length, uint64_t tag = 7) {
    const IoRequest request{
        .tag = tag, .kind = kind, .file = 0, .offset = offset, .buffer = buffer, .length = length};
    EXPECT_TRUE(backend_->Submit({&request, 1}).ok());
    IoCompletion done;
    size_t n = 0;
    for (int tries = 0; n == 0 && tries < 100; ++tries) {
      n = backend_->Reap({&done, 1}, absl::Milliseconds(100));
    }
    EXPECT_EQ(n, 1u);
    EXPECT_EQ(done.tag, tag);
    return done.result;
  }

  static constexpr uint32_t kFileBytes = 1 << 20;
  int fd_ = -1;
  std::unique_ptr<IoBackend> backend_;
};

TEST_P(IoBackendTest, WhatIsWrittenAtAnOffsetIsReadBackThere) {
  std::vector<char> out(8192), in(8192, 0);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(i * 7 + 1);
  EXPECT_EQ(Do(IoKind::kWrite, 65536, out.data(), 8192), 8192);
  EXPECT_EQ(Do(IoKind::kSync, 0, nullptr, 0), 0);
  EXPECT_EQ(Do(IoKind::kRead, 65536, in.data(), 8192), 8192);
  EXPECT_EQ(out, in);
  EXPECT_EQ(Do(IoKind::kRead, 0, in.data(), 4096), 4096);
  EXPECT_EQ(in[0], 0);  // untouched: the file's zeros
}

TEST_P(IoBackendTest, AReadPastTheEndIsShort) {
  std::vector<char> in(8192);
  EXPECT_EQ(Do(IoKind::kRead, kFileBytes - 4096, in.data(), 8192), 4096);
  EXPECT_EQ(Do(IoKind::kRead, kFileBytes, in.data(), 4096), 0);
}

TEST_P(IoBackendTest, ManyRequestsInFlightAllCompleteWithTheirTags) {
  std::vector<std::vector<char>> buffers(8, std::vector<char>(4096, 'x'));
  std::vector<IoRequest> requests;
  for (uint64_t i = 0; i < 8; ++i) {
    requests.push_back({.tag = 100 + i,
                        .kind = IoKind::kWrite,
                        .offset = i * 4096,
                        .buffer = buffers[i].data(),
                        .length = 4096});
  }
  ASSERT_TRUE(backend_->Submit(requests).ok());
  std::vector<bool> seen(8, false);
  IoCompletion done[8];
  for (size_t got = 0, tries = 0; got < 8 && tries < 100; ++tries) {
    const size_t n = backend_->Reap({done, 8}, absl::Milliseconds(100));
    for (size_t k = 0; k < n; ++k, ++got) {
      ASSERT_GE(done[k].tag, 100u);
      ASSERT_LT(done[k].tag, 108u);
      EXPECT_EQ(done[k].result, 4096);
      seen[done[k].tag - 100] = true;
    }
  }
  EXPECT_EQ(seen, std::vector<bool>(8, true));
}

TEST_P(IoBackendTest, TheFaultInjectorFailsAndShortensWhatItIsToldTo) {
  auto faults = std::make_unique<FaultInjectingBackend>(std::move(backend_));
  FaultInjectingBackend* f = faults.get();
  backend_ = std::move(faults);
  std::vector<char> buffer(8192, 'y');
  f->FailNext(IoKind::kWrite, EIO);
  EXPECT_EQ(Do(IoKind::kWrite, 0, buffer.data(), 8192), -EIO);
  f->ShortenNext(IoKind::kWrite);
  EXPECT_EQ(Do(IoKind::kWrite, 0, buffer.data(), 8192), 4096);
  EXPECT_EQ(Do(IoKind::kWrite, 0, buffer.data(), 8192), 8192);  // once only
  f->FailNextIn(IoKind::kRead, 0, 65536, 131072, ENOSPC);
  EXPECT_EQ(Do(IoKind::kRead, 0, buffer.data(), 4096), 4096);  // outside the range
  EXPECT_EQ(Do(IoKind::kRead, 65536, buffer.data(), 4096), -ENOSPC);
  EXPECT_EQ(f->seen(IoKind::kWrite), 3u);
  EXPECT_EQ(f->submitted_offsets().size(), 5u);
}

INSTANTIATE_TEST_SUITE_P(Backends, IoBackendTest, ::testing::Values(Kind::kUring, Kind::kThreads),
                         [](const ::testing::TestParamInfo<Kind>& info) {
                           return info.param == Kind::kUring ? "IoUring" : "Threads";
                         });

TEST(IoBackendKindTest, NamesParseBackAndAnythingElseIsRefused) {
  for (IoBackendKind kind :
       {IoBackendKind::kAuto, IoBackendKind::kUring, IoBackendKind::kThreads}) {
    absl::StatusOr<IoBackendKind> parsed = ParseIoBackendKind(IoBackendName(kind));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_TRUE(absl::IsInvalidArgument(ParseIoBackendKind("spdk").status()));
}

}  // namespace
}  // namespace tierd::daemon
