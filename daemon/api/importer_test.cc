// The importer over a real chunk service and real files: what a client sends is checked before a
// byte is read, a file that changes or ends early fails the import, a failed import leaves the
// session's pins as they were, and a session that ends stops its import before its chunks go.
#include "daemon/api/importer.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/unix_socket.h"
#include "daemon/tiers/host/host_memory.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint64_t kChunk = 1 << 20;
constexpr uint64_t kFile = 3 << 20;

class ImporterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HostPoolOptions o{.capacity = 4 * kSeg,
                      .segment_size = kSeg,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    pool_ = std::move(*CreateHostPool(o));
    service_ = std::make_unique<ChunkService>(NodeTiers(pool_.get()));
    alice_ = *sessions_.Open({1000, 1000, 1}, "alice");
    bob_ = *sessions_.Open({2000, 2000, 2}, "bob");
    chunk_ = (*service_->Allocate(*alice_, std::vector<ChunkRequest>{{.size = kChunk}}))[0];
    // /var/tmp is on disk (O_DIRECT), where /tmp may be tmpfs.
    char path[] = "/var/tmp/tierd-importer-XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    path_ = path;
    content_.resize(kFile);
    for (uint64_t i = 0; i < kFile; ++i) content_[i] = static_cast<char>(i * 7 + (i >> 9));
    ASSERT_EQ(pwrite(fd, content_.data(), kFile, 0), static_cast<ssize_t>(kFile));
    close(fd);
  }
  void TearDown() override { unlink(path_.c_str()); }

  // The chunk acquired for writing in the host tier, filled with 0xAB; its memory.
  std::span<char> Hold(Access access = Access::kOverwrite) {
    auto acquired = service_->Acquire(*alice_, {&chunk_, 1}, TierKind::kHost, access);
    EXPECT_TRUE(acquired.ok()) << acquired.status();
    char* at = static_cast<char*>(pool_->Address(acquired->locations[0]));
    std::memset(at, 0xAB, kChunk);
    return {at, kChunk};
  }

  ImportJob Job(std::vector<ImportRange> ranges, int flags = O_RDONLY) {
    ImportJob job;
    job.session = alice_;
    job.chunk = chunk_;
    job.file = UniqueFd(open(path_.c_str(), flags | O_CLOEXEC));
    struct stat st {};
    EXPECT_EQ(stat(path_.c_str(), &st), 0);
    job.file_size = static_cast<uint64_t>(st.st_size);
    job.file_mtime_ns = st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    job.ranges = std::move(ranges);
    return job;
  }

  bool Untouched(std::span<char> chunk) const {
    for (char c : chunk) {
      if (c != static_cast<char>(0xAB)) return false;
    }
    return true;
  }

  std::unique_ptr<SegmentPool> pool_;
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> alice_, bob_;
  ChunkId chunk_ = 0;
  std::string path_;
  std::vector<char> content_;
  std::atomic<bool> no_cancel_{false};
};

TEST_F(ImporterTest, EachRangeLandsAtItsPlaceInTheChunkAndTheClientsPinIsAsItWas) {
  std::span<char> chunk = Hold();
  Importer importer(service_.get());
  ImportJob job = Job({{.file_offset = 8 + 1234, .chunk_offset = 0, .length = 300000},
                       {.file_offset = 2 << 20, .chunk_offset = 524288, .length = 4096},
                       {.file_offset = kFile - 10, .chunk_offset = kChunk - 10, .length = 10}});
  ImportOutcome out = importer.Run(job, no_cancel_);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_EQ(out.bytes, 300000u + 4096 + 10);
  // Without the page cache wherever the file system takes O_DIRECT.
  const int direct = open(path_.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  EXPECT_EQ(out.direct, direct >= 0);
  if (direct >= 0) close(direct);
  for (const ImportRange& r : job.ranges) {
    EXPECT_EQ(std::memcmp(chunk.data() + r.chunk_offset, &content_[r.file_offset], r.length), 0);
  }
  EXPECT_EQ(chunk[300000], static_cast<char>(0xAB));  // between the ranges: as it was
  // The session's one acquisition is all it holds: one release, and the chunk is free to go.
  EXPECT_TRUE(service_->Release(*alice_, {&chunk_, 1}).ok());
  EXPECT_TRUE(service_->Free(*alice_, {&chunk_, 1}).ok());
}

TEST_F(ImporterTest, RangesOutsideTheFileOrTheChunkOrOverlappingAreRefusedBeforeAByteIsRead) {
  std::span<char> chunk = Hold();
  Importer importer(service_.get());
  const std::vector<std::pair<std::vector<ImportRange>, std::string>> bad = {
      {{}, "1 to 256 ranges"},
      {{{.file_offset = 0, .chunk_offset = 0, .length = 0}}, "is empty or not inside the file"},
      {{{.file_offset = kFile - 4, .chunk_offset = 0, .length = 8}}, "not inside the file"},
      {{{.file_offset = UINT64_MAX - 2, .chunk_offset = 0, .length = 8}}, "not inside the file"},
      {{{.file_offset = 0, .chunk_offset = kChunk - 4, .length = 8}}, "is not inside it"},
      {{{.file_offset = 0, .chunk_offset = UINT64_MAX - 2, .length = 8}}, "is not inside it"},
      {{{.file_offset = 0, .chunk_offset = 100, .length = 50},
        {.file_offset = 0, .chunk_offset = 120, .length = 50}},
       "ranges overlap in chunk"},
  };
  for (const auto& [ranges, why] : bad) {
    ImportJob job = Job(ranges);
    ImportOutcome out = importer.Run(job, no_cancel_);
    EXPECT_TRUE(absl::IsInvalidArgument(out.status)) << out.status;
    EXPECT_NE(out.status.message().find(why), std::string::npos) << out.status;
    EXPECT_EQ(out.bytes, 0u);
  }
  EXPECT_TRUE(Untouched(chunk));
  EXPECT_TRUE(service_->Release(*alice_, {&chunk_, 1}).ok());
  EXPECT_TRUE(service_->Free(*alice_, {&chunk_, 1}).ok());  // no pin left behind
}

TEST_F(ImporterTest, AFileOtherThanTheOneWhoseLayoutTheClientReadIsRefused) {
  std::span<char> chunk = Hold();
  Importer importer(service_.get());
  ImportJob bigger = Job({{.file_offset = 0, .chunk_offset = 0, .length = 16}});
  bigger.file_size += 1;
  ImportJob touched = Job({{.file_offset = 0, .chunk_offset = 0, .length = 16}});
  touched.file_mtime_ns -= 1;
  for (ImportJob* job : {&bigger, &touched}) {
    ImportOutcome out = importer.Run(*job, no_cancel_);
    EXPECT_TRUE(absl::IsFailedPrecondition(out.status)) << out.status;
    EXPECT_NE(out.status.message().find("changed since its layout was read"), std::string::npos);
  }
  EXPECT_TRUE(Untouched(chunk));
}

TEST_F(ImporterTest, AFileChangedWhileItIsReadFailsTheImport) {
  Hold();
  ImporterOptions o;
  o.after_read = [this](const ImportJob&) {
    const timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};  // another modification time
    ASSERT_EQ(utimensat(AT_FDCWD, path_.c_str(), times, 0), 0);
  };
  Importer importer(service_.get(), o);
  ImportJob job = Job({{.file_offset = 0, .chunk_offset = 0, .length = 65536}});
  ImportOutcome out = importer.Run(job, no_cancel_);
  EXPECT_TRUE(absl::IsAborted(out.status)) << out.status;
  EXPECT_NE(out.status.message().find("changed while it was read"), std::string::npos);
  EXPECT_TRUE(service_->Release(*alice_, {&chunk_, 1}).ok());
  EXPECT_TRUE(service_->Free(*alice_, {&chunk_, 1}).ok());
}

TEST_F(ImporterTest, AFileCutShortUnderTheImportIsAShortReadNamingWhereItEnds) {
  Hold();
  ImporterOptions o;
  o.before_read = [this](const ImportJob&) { ASSERT_EQ(truncate(path_.c_str(), 1 << 20), 0); };
  Importer importer(service_.get(), o);
  ImportJob job = Job({{.file_offset = (1 << 20) - 100, .chunk_offset = 0, .length = 200000}});
  ImportOutcome out = importer.Run(job, no_cancel_);
  EXPECT_TRUE(absl::IsOutOfRange(out.status)) << out.status;
  EXPECT_NE(out.status.message().find("ends at byte 1048576"), std::string::npos) << out.status;
  EXPECT_TRUE(service_->Release(*alice_, {&chunk_, 1}).ok());
  EXPECT_TRUE(service_->Free(*alice_, {&chunk_, 1}).ok());
}

TEST_F(ImporterTest, WhatIsNotARegularFileOpenForReadingIsRefused) {
  std::span<char> chunk = Hold();
  Importer importer(service_.get());
  const std::vector<ImportRange> one = {{.file_offset = 0, .chunk_offset = 0, .length = 16}};
  ImportJob write_only = Job(one, O_WRONLY);
  ImportJob path_only = Job(one, O_PATH);
  ImportJob pipe_end = Job(one);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  pipe_end.file = UniqueFd(p[0]);
  close(p[1]);
  for (ImportJob* job : {&write_only, &path_only, &pipe_end}) {
    ImportOutcome out = importer.Run(*job, no_cancel_);
    EXPECT_TRUE(absl::IsInvalidArgument(out.status)) << out.status;
  }
  EXPECT_TRUE(Untouched(chunk));
}

TEST_F(ImporterTest, OnlyAChunkTheSessionHoldsForWritingInTheHostTierIsWritten) {
  Importer importer(service_.get());
  const std::vector<ImportRange> one = {{.file_offset = 0, .chunk_offset = 0, .length = 16}};
  ImportJob not_held = Job(one);
  EXPECT_TRUE(absl::IsFailedPrecondition(importer.Run(not_held, no_cancel_).status));
  std::span<char> chunk = Hold(Access::kRead);
  ImportJob read_only = Job(one);
  EXPECT_TRUE(absl::IsFailedPrecondition(importer.Run(read_only, no_cancel_).status));
  ImportJob bobs = Job(one);
  bobs.session = bob_;
  EXPECT_TRUE(absl::IsPermissionDenied(importer.Run(bobs, no_cancel_).status));
  EXPECT_TRUE(Untouched(chunk));
}

TEST_F(ImporterTest, AClientsReleaseDuringAnImportLeavesTheChunkPinnedUntilTheImportEnds) {
  Hold();
  ImporterOptions o;
  o.before_read = [this](const ImportJob&) {
    ASSERT_TRUE(service_->Release(*alice_, {&chunk_, 1}).ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(service_->Free(*alice_, {&chunk_, 1})));
  };
  Importer importer(service_.get(), o);
  ImportJob job = Job({{.file_offset = 0, .chunk_offset = 0, .length = kChunk}});
  EXPECT_TRUE(importer.Run(job, no_cancel_).status.ok());
  EXPECT_TRUE(service_->Free(*alice_, {&chunk_, 1}).ok());
}

// The reply of a queued import, read from the other end of its connection.
ImportReply ReplyOn(int fd) {
  ImportReply reply{};
  std::vector<UniqueFd> fds;
  absl::StatusOr<size_t> n = ReceiveWithFds(fd, &reply, sizeof(reply), &fds);
  EXPECT_TRUE(n.ok() && *n == sizeof(reply));
  return reply;
}

TEST_F(ImporterTest, OneImportOfASessionAtATimeEachRepliedOnItsConnection) {
  Hold();
  absl::Notification started, go;
  ImporterOptions o;
  o.before_read = [&](const ImportJob&) {
    if (!started.HasBeenNotified()) started.Notify();
    go.WaitForNotification();
  };
  Importer importer(service_.get(), o);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd client(sv[0]);
  ImportJob first = Job({{.file_offset = 0, .chunk_offset = 0, .length = kChunk}});
  first.reply_to = UniqueFd(sv[1]);
  ASSERT_TRUE(importer.Submit(std::move(first)).ok());
  started.WaitForNotification();
  ImportJob second = Job({{.file_offset = 0, .chunk_offset = 0, .length = 16}});
  EXPECT_TRUE(absl::IsResourceExhausted(importer.Submit(std::move(second))));
  go.Notify();
  ImportReply reply = ReplyOn(client.get());
  EXPECT_EQ(reply.status_code, 0) << reply.message;
  EXPECT_EQ(reply.bytes, kChunk);
  // Once its reply is there, the session's next import is taken.
  ImportJob third = Job({{.file_offset = 0, .chunk_offset = 0, .length = 16}});
  int again[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, again), 0);
  UniqueFd client_again(again[0]);
  third.reply_to = UniqueFd(again[1]);
  EXPECT_TRUE(importer.Submit(std::move(third)).ok());
  EXPECT_EQ(ReplyOn(client_again.get()).status_code, 0);
}

TEST_F(ImporterTest, ASessionThatEndsStopsItsImportAndItsChunksGoOnlyOnceItHasStopped) {
  Hold();
  absl::Notification started, go, ended;
  std::atomic<bool> imported{false};
  ImporterOptions o;
  o.before_read = [&](const ImportJob&) {
    started.Notify();
    go.WaitForNotification();
  };
  o.after_read = [&](const ImportJob&) { imported = true; };
  Importer importer(service_.get(), o);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd client(sv[0]);
  ImportJob job = Job({{.file_offset = 0, .chunk_offset = 0, .length = kChunk}});
  job.reply_to = UniqueFd(sv[1]);
  ASSERT_TRUE(importer.Submit(std::move(job)).ok());
  started.WaitForNotification();
  // The session's end does not wait for the read (a hung file system would hold the caller):
  // it runs once the import has let go of the chunk.
  size_t freed = 0;
  importer.EndSession(alice_->id, [&] {
    freed = service_->CloseSession(*alice_);
    ended.Notify();
  });
  EXPECT_FALSE(ended.HasBeenNotified());
  EXPECT_EQ(service_->chunk_count(), 1u);
  go.Notify();
  ended.WaitForNotification();
  EXPECT_FALSE(imported);  // stopped before reading
  EXPECT_EQ(freed, 1u);
  EXPECT_EQ(service_->chunk_count(), 0u);
  ImportReply reply = ReplyOn(client.get());
  EXPECT_EQ(reply.status_code, static_cast<int32_t>(absl::StatusCode::kCancelled)) << reply.message;
  EXPECT_EQ(reply.bytes, 0u);
}

TEST_F(ImporterTest, ASessionWithoutAnImportUnderWayEndsAtOnce) {
  Importer importer(service_.get());
  bool ended = false;
  importer.EndSession(alice_->id, [&] { ended = true; });
  EXPECT_TRUE(ended);
}

}  // namespace
}  // namespace tierd::daemon
