// The chunk service across stops: persistent chunks recovered from the NVMe index, a rewrite cut
// short, chunks at home in memory written down at a clean stop and reported lost after a crash.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/chunks/chunk_service_nvme_fixture.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

TEST_F(ChunkServiceNvmeTest, PersistentChunksAreRecoveredFromTheIndex) {
  std::vector<ChunkRequest> r = {{.size = 1 << 20, .name = "job/opt/m/0", .persistent = true},
                                 {.size = 300000, .name = "job/opt/v/0", .persistent = true},
                                 {.size = 4096, .name = "job/never-written", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  std::vector<ChunkId> written = {ids[0], ids[1]};
  Write(*session_, written, 8);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, written, TierKind::kNvme)).ok());
  EXPECT_EQ(Restart(/*clean=*/false), 2u);  // the daemon goes away and comes back
  auto s2 = *sessions_.Open({1000, 1000, 2}, "after-restart");
  MapPage(*s2);
  std::vector<ChunkRequest> open = {
      {.size = 1 << 20, .name = "job/opt/m/0", .persistent = true, .open_existing = true},
      {.size = 300000, .name = "job/opt/v/0", .persistent = true, .open_existing = true}};
  auto reopened = service_->Allocate(*s2, open);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  ASSERT_TRUE(Wait(*s2, service_->Prefetch(*s2, *reopened, TierKind::kHost, 0)).ok());
  // Same bytes, even though the chunk ids are new.
  auto a = *service_->Acquire(*s2, *reopened, TierKind::kHost, Access::kRead);
  const auto* w = static_cast<const uint64_t*>(host_->Address(a.locations[1]));
  for (size_t j = 0; j < 300000 / 8; ++j) ASSERT_EQ(w[j], Word(8, ids[1], j)) << j;
  // Another user sees none of it.
  auto other = *sessions_.Open({2000, 2000, 3}, "other");
  EXPECT_TRUE(service_->List(*other, 0, 100).chunks.empty());
}

// A persistent chunk rewritten in place lost its durable version when the rewrite stopped halfway
// (the daemon died, the drive failed): the old bytes were partly overwritten and the index still
// named their checksum, so the chunk read back as DATA_LOSS. A rewrite now goes to fresh space and
// the index switch is its commit point: until then the previous version stays whole.
// (At home on NVMe: a chunk at home in memory written since its copy is lost in a crash instead.)
TEST_F(ChunkServiceNvmeTest, ARewriteThatStopsHalfwayLeavesThePreviousVersionWhole) {
  std::vector<ChunkRequest> r = {
      {.size = 1 << 20, .home = TierKind::kNvme, .name = "job/state", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 21);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  const ChunkId old_id = ids[0];
  Write(*session_, ids, 22);  // brought back, and rewritten on the host
  // The rewrite's first sub-I/O fails; the others reach the drive.
  faults_->FailNext(IoKind::kWrite, EIO);
  const absl::Status failed = Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme));
  ASSERT_FALSE(failed.ok());
  ASSERT_EQ(Restart(/*clean=*/false), 1u);
  auto after = *sessions_.Open({1000, 1000, 2}, "after");
  MapPage(*after);
  r[0].open_existing = true;
  auto reopened = *service_->Allocate(*after, r);
  auto a = service_->Acquire(*after, reopened, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::Status read = Wait(*after, a->ready);
  ASSERT_TRUE(read.ok()) << read;
  const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[0]));
  for (size_t j = 0; j < (1 << 20) / 8; ++j) ASSERT_EQ(w[j], Word(21, old_id, j)) << j;
}

// A persistent chunk at home in the host tier has no write-back: its data lives in memory. A clean
// stop writes it to NVMe, and it comes back after the restart.
TEST_F(ChunkServiceNvmeTest, AChunkAtHomeInMemoryIsWrittenDownAtACleanStopAndComesBack) {
  std::vector<ChunkRequest> r = {{.size = 1 << 20, .name = "job/host-state", .persistent = true},
                                 {.size = 300000, .name = "job/host-meta", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 31);
  ASSERT_EQ(Restart(/*clean=*/true), 2u);
  auto after = *sessions_.Open({1000, 1000, 2}, "after");
  MapPage(*after);
  for (ChunkRequest& c : r) c.open_existing = c.must_exist = true;
  auto reopened = service_->Allocate(*after, r);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto a = service_->Acquire(*after, *reopened, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Wait(*after, a->ready).ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[i]));
    for (size_t j = 0; j < r[i].size / 8; ++j)
      ASSERT_EQ(w[j], Word(31, ids[i], j)) << i << " " << j;
  }
}

// Written since its last copy reached NVMe (or never copied there), a chunk at home in memory is
// lost when the daemon dies: the restart says so, and never hands out the older copy or a fresh
// zeroed chunk under its name.
TEST_F(ChunkServiceNvmeTest, AChunkAtHomeInMemoryWrittenSinceItsLastCopyIsLostInACrashNeverOlder) {
  std::vector<ChunkRequest> r = {
      {.size = 1 << 20, .name = "job/copied-then-written", .persistent = true},
      {.size = 8192, .name = "job/never-copied", .persistent = true},
      {.size = 4096, .name = "job/copied", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 41);
  const std::vector<ChunkId> copied = {ids[0], ids[2]};
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, copied, TierKind::kNvme, true)).ok());
  Write(*session_, {ids[0]}, 42);           // newer than its copy on NVMe
  EXPECT_EQ(Restart(/*clean=*/false), 1u);  // only job/copied
  auto after = *sessions_.Open({1000, 1000, 2}, "after");
  MapPage(*after);
  for (size_t i = 0; i < 2; ++i) {
    std::vector<ChunkRequest> open = {r[i]};
    open[0].open_existing = open[0].must_exist = true;
    auto reopened = service_->Allocate(*after, open);
    ASSERT_EQ(reopened.status().code(), absl::StatusCode::kDataLoss) << reopened.status();
    EXPECT_NE(reopened.status().message().find("was lost"), std::string::npos);
    const std::vector<ChunkRequest> create = {
        {.size = r[i].size, .name = r[i].name, .persistent = true}};
    auto created = service_->Allocate(*after, create);
    EXPECT_EQ(created.status().code(), absl::StatusCode::kAlreadyExists) << created.status();
  }
  std::vector<ChunkRequest> open = {r[2]};
  open[0].open_existing = open[0].must_exist = true;
  auto kept = service_->Allocate(*after, open);
  ASSERT_TRUE(kept.ok()) << kept.status();
  auto a = *service_->Acquire(*after, *kept, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(Wait(*after, a.ready).ok());
  const auto* w = static_cast<const uint64_t*>(host_->Address(a.locations[0]));
  for (size_t j = 0; j < 4096 / 8; ++j) ASSERT_EQ(w[j], Word(41, ids[2], j)) << j;
  ASSERT_TRUE(service_->Release(*after, *kept).ok());
  // The owner sees the lost chunks, frees them, and may then start afresh under their names.
  std::vector<ChunkId> lost;
  for (const ChunkMeta& c : service_->List(*after, 0, 100).chunks) {
    if (c.lost) lost.push_back(c.id);
  }
  ASSERT_EQ(lost.size(), 2u);
  ASSERT_TRUE(service_->Free(*after, lost).ok());
  const std::vector<ChunkRequest> again = {r[0], r[1]};
  auto fresh = service_->Allocate(*after, again);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  // Freed for good: the index no longer names them after another crash.
  EXPECT_EQ(Restart(/*clean=*/false), 1u);
  EXPECT_EQ(service_->List(*after, 0, 100).chunks.size(), 1u);
}

// Opening a chunk at home in memory after a clean stop and writing it makes its NVMe copy old: a
// crash then reports it lost, and the write's Acquire completes only once the index says so.
TEST_F(ChunkServiceNvmeTest, WritingAChunkRestoredFromACleanStopMakesACrashReportItLost) {
  std::vector<ChunkRequest> r = {{.size = 65536, .name = "job/resumed", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 51);
  ASSERT_EQ(Restart(/*clean=*/true), 1u);
  auto after = *sessions_.Open({1000, 1000, 2}, "after");
  MapPage(*after);
  r[0].open_existing = true;
  auto reopened = *service_->Allocate(*after, r);
  Write(*after, reopened, 52);
  EXPECT_EQ(Restart(/*clean=*/false), 0u);
  auto third = *sessions_.Open({1000, 1000, 3}, "third");
  EXPECT_EQ(service_->Allocate(*third, r).status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace tierd::daemon
