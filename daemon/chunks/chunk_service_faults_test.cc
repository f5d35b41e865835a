// The chunk service when the drive misbehaves: write and index errors, no space, short transfers,
// a slow drive and damaged data, each named to the client and losing nothing acknowledged.
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

TEST_F(ChunkServiceNvmeTest, WriteErrorFailsTheEvictNamingTheChunkAndKeepsTheHostCopy) {
  auto ids = Alloc(*session_, {1 << 20});
  Write(*session_, ids, 3);
  faults_->FailNext(IoKind::kWrite, EIO);
  absl::Status s = Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme));
  EXPECT_FALSE(s.ok());
  // The completion page carries the code and the message, naming the chunk and the cause.
  EXPECT_NE(s.message().find(absl::StrCat("chunk ", ids[0])), std::string::npos) << s;
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_EQ(stat[0].state, ChunkState::kReady);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kNvme));  // the failed copy is not valid
  EXPECT_TRUE(Check(*session_, ids, 3, {1 << 20}));
  // The next attempt succeeds: the daemon keeps serving.
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  EXPECT_TRUE(Check(*session_, ids, 3, {1 << 20}));
}

// The index goes through the same I/O seam as the data: a failed write of a persistent chunk's
// record fails its eviction, the chunk keeps its bytes in memory, and the next attempt commits it
// so that it survives a restart.
TEST_F(ChunkServiceNvmeTest, AFailedIndexWriteFailsThePersistAndTheChunkKeepsItsData) {
  std::vector<ChunkRequest> r = {{.size = 1 << 20, .name = "job/indexed", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 6);
  // The index is in region 0 between its header and its data (index_size 1 MiB).
  faults_->FailNextIn(IoKind::kWrite, 0, kRegionHeaderBytes, kRegionHeaderBytes + (1 << 20), EIO);
  absl::Status s = Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s;
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kNvme));  // not committed: not a copy
  EXPECT_TRUE(Check(*session_, ids, 6, {1 << 20}));
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_EQ(Restart(/*clean=*/false), 1u);
  auto again = *sessions_.Open({1000, 1000, 2}, "after-restart");
  MapPage(*again);
  r[0].open_existing = true;
  auto reopened = service_->Allocate(*again, r);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  ASSERT_TRUE(Wait(*again, service_->Prefetch(*again, *reopened, TierKind::kHost, 0)).ok());
  auto a = *service_->Acquire(*again, *reopened, TierKind::kHost, Access::kRead);
  const auto* w = static_cast<const uint64_t*>(host_->Address(a.locations[0]));
  for (size_t j = 0; j < (1 << 20) / 8; j += 4099) ASSERT_EQ(w[j], Word(6, ids[0], j)) << j;
}

TEST_F(ChunkServiceNvmeTest, NoSpaceOnTheDriveIsResourceExhausted) {
  auto ids = Alloc(*session_, {1 << 20});
  Write(*session_, ids, 4);
  faults_->FailNext(IoKind::kWrite, ENOSPC);
  absl::Status s = Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
}

TEST_F(ChunkServiceNvmeTest, FullNvmeTierIsResourceExhaustedAndTheRestStillMoves) {
  // Two 96 MiB regions hold 2 x 94 MiB = 188 MiB of data; fill it with NVMe-home chunks.
  std::vector<ChunkRequest> big(47, ChunkRequest{.size = 4 << 20, .home = TierKind::kNvme});
  ASSERT_TRUE(service_->Allocate(*session_, big).ok());
  std::vector<ChunkRequest> more = {{.size = 4 << 20, .home = TierKind::kNvme}};
  absl::Status full = service_->Allocate(*session_, more).status();
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_NE(full.message().find("NVMe tier full"), std::string::npos) << full;
  // A host chunk that cannot get NVMe space fails its eviction; the host copy stays.
  auto ids = Alloc(*session_, {1 << 20});
  Write(*session_, ids, 9);
  absl::Status s = Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_TRUE(Check(*session_, ids, 9, {1 << 20}));
}

TEST_F(ChunkServiceNvmeTest, ShortTransfersAreInvisibleToTheClient) {
  const std::vector<uint64_t> sizes = {2 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 5);
  faults_->ShortenNext(IoKind::kWrite, 7);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  faults_->ShortenNext(IoKind::kRead, 7);
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  EXPECT_TRUE(Check(*session_, ids, 5, sizes));
  EXPECT_EQ(nvme_->stats().short_transfers, 14u);
}

TEST_F(ChunkServiceNvmeTest, SlowDriveStillCompletesEveryRequest) {
  auto ids = Alloc(*session_, {512 << 10, 512 << 10});
  Write(*session_, ids, 6);
  faults_->SetDelay(absl::Milliseconds(5));
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_TRUE(Check(*session_, ids, 6, {512 << 10, 512 << 10}));
}

TEST_F(ChunkServiceNvmeTest, DamagedDataOnTheDriveIsDataLossNeverHandedOut) {
  auto ids = Alloc(*session_, {256 << 10});
  Write(*session_, ids, 7);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  // Flip one byte of the chunk on the drive: a 256 KiB chunk is one stripe unit in one region.
  bool flipped = false;
  for (const char* name : {"/r0", "/r1"}) {
    int fd = open((dir_ + name).c_str(), O_RDWR);
    std::vector<char> buf(1 << 20);
    for (off_t off = 2 << 20; !flipped && pread(fd, buf.data(), buf.size(), off) > 0;
         off += buf.size()) {
      uint64_t first = Word(7, ids[0], 0);
      for (size_t i = 0; i + 8 <= buf.size(); i += 4096) {
        if (std::memcmp(buf.data() + i, &first, 8) == 0) {
          char c = buf[i + 100] ^ 0x01;
          ASSERT_EQ(pwrite(fd, &c, 1, off + i + 100), 1);
          flipped = true;
          break;
        }
      }
    }
    close(fd);
    if (flipped) break;
  }
  ASSERT_TRUE(flipped);
  EXPECT_EQ(nvme_->checksum_failures(), 0);
  absl::Status s = Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_EQ(nvme_->checksum_failures(), 1);  // counted for the operator (metrics)
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.empty());  // no copy is trusted
  EXPECT_TRUE(absl::IsDataLoss(service_->Prefetch(*session_, ids, TierKind::kHost, 0).status()));
}

// The index holds one record per persistent chunk. 66,000 tiny persistent chunks filled it, and
// then nobody could persist anything; now a persistent chunk takes at least the granule of NVMe
// space, so the space (and its owner's quota) runs out first.
TEST_F(ChunkServiceNvmeTest, TinyPersistentChunksRunOutOfSpaceBeforeTheIndexFills) {
  ASSERT_GT(nvme_->persistent_granule(), 4096u);
  int created = 0;
  absl::Status s;
  std::vector<ChunkId> ids;
  const int most = static_cast<int>(nvme_->index_records());  // what used to fill the index
  for (int i = 0; i <= most && s.ok(); ++i) {
    std::vector<ChunkRequest> r = {
        {.size = 4096, .name = absl::StrCat("tiny/", i), .persistent = true}};
    auto id = service_->Allocate(*session_, r);
    ASSERT_TRUE(id.ok()) << id.status();
    s = Wait(*session_, service_->Evict(*session_, *id, TierKind::kNvme));
    if (s.ok()) {
      ++created;
      ids.push_back((*id)[0]);
    }
  }
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("NVMe tier full"), std::string::npos) << s;
  EXPECT_LE(static_cast<size_t>(created) * 5 / 4, nvme_->index_records());
  // Freeing one makes room for another.
  ASSERT_TRUE(service_->Free(*session_, {ids.data(), 1}).ok());
  nvme_->Drain();
  std::vector<ChunkRequest> r = {{.size = 4096, .name = "tiny/again", .persistent = true}};
  auto again = *service_->Allocate(*session_, r);
  EXPECT_TRUE(Wait(*session_, service_->Evict(*session_, again, TierKind::kNvme)).ok());
}

}  // namespace
}  // namespace tierd::daemon
