// The range reader over a real file, buffered and with O_DIRECT where the file system allows it:
// every byte lands where it was asked for whatever the alignment, a short transfer goes on, a
// range past the end of the file and an I/O error are clear errors, and a cancel stops it.
#include "daemon/io/range_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kFileBytes = 3 << 20;
constexpr char kName[] = "checkpoint.safetensors";

class RangeReaderTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    // /var/tmp is on disk where /tmp may be tmpfs, which may refuse O_DIRECT.
    char path[] = "/var/tmp/tierd-range-reader-XXXXXX";
    fd_ = mkstemp(path);
    ASSERT_GE(fd_, 0);
    path_ = path;
    content_.resize(kFileBytes);
    for (uint64_t i = 0; i < kFileBytes; ++i) content_[i] = static_cast<char>(i * 131 + (i >> 11));
    ASSERT_EQ(pwrite(fd_, content_.data(), kFileBytes, 0), static_cast<ssize_t>(kFileBytes));
    read_fd_ = fd_;
    if (direct()) {
      read_fd_ = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
      if (read_fd_ < 0) GTEST_SKIP() << "O_DIRECT is refused here: " << std::strerror(errno);
    }
    const int fds[] = {read_fd_};
    backend_ = std::make_unique<FaultInjectingBackend>(MakeThreadPoolBackend(fds, 8, 2));
    if (auto uring = MakeUringBackend(fds, UringOptions{.queue_depth = 8}); uring.ok()) {
      backend_ = std::make_unique<FaultInjectingBackend>(std::move(*uring));
    }
  }
  void TearDown() override {
    backend_.reset();
    if (read_fd_ >= 0 && read_fd_ != fd_) close(read_fd_);
    if (fd_ >= 0) close(fd_);
    if (!path_.empty()) unlink(path_.c_str());
  }
  bool direct() const { return GetParam(); }
  RangeReaderOptions Options() const {
    // Small pieces, so that a range is many of them.
    return RangeReaderOptions{
        .queue_depth = 4, .io_size = 64 << 10, .direct_alignment = direct() ? 4096u : 0u};
  }

  int fd_ = -1;
  int read_fd_ = -1;
  std::string path_;
  std::vector<char> content_;
  std::unique_ptr<FaultInjectingBackend> backend_;
  std::atomic<bool> no_cancel_{false};
};

TEST_P(RangeReaderTest, ReadsEveryRangeToItsPlaceWhateverItsAlignment) {
  std::vector<char> out(1 << 20, 0);
  // Unaligned starts, lengths of one byte to several pieces, the file's last byte.
  const std::vector<ReadRange> ranges = {
      {.offset = 13, .length = 1, .dst = out.data()},
      {.offset = 4095, .length = 200000, .dst = out.data() + 7},
      {.offset = 1 << 20, .length = 65536, .dst = out.data() + 300000},
      {.offset = kFileBytes - 777, .length = 777, .dst = out.data() + 400001},
  };
  RangeReader reader(Options());
  uint64_t bytes = 0;
  ASSERT_TRUE(reader.Read(*backend_, ranges, no_cancel_, &bytes, kName).ok());
  uint64_t want = 0;
  for (const ReadRange& r : ranges) {
    want += r.length;
    EXPECT_EQ(std::string(r.dst, r.length), std::string(&content_[r.offset], r.length))
        << "range at " << r.offset;
  }
  EXPECT_EQ(bytes, want);
  EXPECT_EQ(out[6], 0);  // nothing outside the destinations
  EXPECT_EQ(out[7 + 200000], 0);
}

TEST_P(RangeReaderTest, AShortTransferGoesOnWhereItStopped) {
  backend_->ShortenNext(IoKind::kRead, 3);
  std::vector<char> out(300000);
  const ReadRange range{.offset = 8192, .length = out.size(), .dst = out.data()};
  RangeReader reader(Options());
  uint64_t bytes = 0;
  ASSERT_TRUE(reader.Read(*backend_, {&range, 1}, no_cancel_, &bytes, kName).ok());
  EXPECT_EQ(std::string(out.data(), out.size()), std::string(&content_[8192], out.size()));
}

TEST_P(RangeReaderTest, ARangePastTheEndOfTheFileIsAShortReadNamingWhereTheFileEnds) {
  std::vector<char> out(100000);
  const ReadRange range{.offset = kFileBytes - 5000, .length = out.size(), .dst = out.data()};
  RangeReader reader(Options());
  uint64_t bytes = 0;
  absl::Status s = reader.Read(*backend_, {&range, 1}, no_cancel_, &bytes, kName);
  EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("checkpoint.safetensors ends at byte " + std::to_string(kFileBytes)),
            std::string::npos)
      << s;
}

TEST_P(RangeReaderTest, AnIoErrorNamesTheFileAndOffsetAndStopsTheRead) {
  backend_->FailNext(IoKind::kRead, EIO);
  std::vector<char> out(1 << 20);
  const ReadRange range{.offset = 0, .length = out.size(), .dst = out.data()};
  RangeReader reader(Options());
  uint64_t bytes = 0;
  absl::Status s = reader.Read(*backend_, {&range, 1}, no_cancel_, &bytes, kName);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("reading checkpoint.safetensors at byte 0"), std::string::npos) << s;
  // The pieces after the error were not started: at most the queue's worth were.
  EXPECT_LE(backend_->seen(IoKind::kRead), 4u);
}

TEST_P(RangeReaderTest, ACancelStartsNothingMore) {
  std::atomic<bool> cancel{true};
  std::vector<char> out(1 << 20);
  const ReadRange range{.offset = 0, .length = out.size(), .dst = out.data()};
  RangeReader reader(Options());
  uint64_t bytes = 0;
  EXPECT_EQ(reader.Read(*backend_, {&range, 1}, cancel, &bytes, kName).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(backend_->seen(IoKind::kRead), 0u);
}

INSTANTIATE_TEST_SUITE_P(BufferedAndDirect, RangeReaderTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Direct" : "Buffered"; });

}  // namespace
}  // namespace tierd::daemon
