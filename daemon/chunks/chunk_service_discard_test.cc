// Discard through the chunk service over a real NVMe tier: a chunk whose contents its session
// declares dead loses its copies without a write, is written again like any other, and nothing
// is discarded that the request may not discard.
#include <vector>

#include "daemon/chunks/chunk_service_nvme_fixture.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST_F(ChunkServiceNvmeTest, ADiscardedChunkLosesItsHostCopyWithoutAWriteAndIsWrittenAgainLater) {
  const std::vector<uint64_t> sizes = {kMiB, kMiB};
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  const std::vector<ChunkId> dead = {ids[0]}, live = {ids[1]};
  Write(*session_, ids, 1);
  const uint64_t host_used = host_->Usage().used_bytes;
  const uint64_t writes = faults_->seen(IoKind::kWrite);

  ASSERT_TRUE(service_->Discard(*session_, dead).ok());
  EXPECT_EQ(host_->Usage().used_bytes, host_used - kMiB);  // its room is free at once
  const ChunkMeta stat = service_->Stat(*session_, dead)->at(0);
  EXPECT_FALSE(stat.allocated.contains(TierKind::kHost));
  EXPECT_TRUE(stat.resident.contains(TierKind::kNvme));
  EXPECT_TRUE(stat.dirty.empty());

  // Both sent down: only the live one is written (1 MiB in 128 KiB I/Os).
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_EQ(faults_->seen(IoKind::kWrite) - writes, kMiB / (128 << 10));
  EXPECT_TRUE(Check(*session_, live, 1, {kMiB}));

  // Read before it is written again, it holds some bytes, never an error; written, it is kept.
  auto read = service_->Acquire(*session_, dead, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(Wait(*session_, read->ready).ok());
  ASSERT_TRUE(service_->Release(*session_, dead).ok());
  Write(*session_, dead, 2);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, dead, TierKind::kNvme)).ok());
  EXPECT_TRUE(Check(*session_, dead, 2, {kMiB}));
}

TEST_F(ChunkServiceNvmeTest, ADiscardedChunkStillAcquiredKeepsItsCopyCleanAndItGoesUnwritten) {
  auto ids = Alloc(*session_, {kMiB}, TierKind::kNvme);
  Write(*session_, ids, 1);
  auto reading = service_->Acquire(*session_, ids, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(reading.ok()) << reading.status();

  ASSERT_TRUE(service_->Discard(*session_, ids).ok());
  const ChunkMeta held = service_->Stat(*session_, ids)->at(0);
  EXPECT_TRUE(held.resident.contains(TierKind::kHost));  // the reader's copy stays
  EXPECT_TRUE(held.dirty.empty());                       // but nothing waits to be written

  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  const uint64_t writes = faults_->seen(IoKind::kWrite);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_EQ(faults_->seen(IoKind::kWrite), writes);
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceNvmeTest, AChunkWithNoNvmeSpaceKeepsItsHostCopyWhenDiscarded) {
  auto ids = Alloc(*session_, {kMiB});  // at home on the host
  Write(*session_, ids, 1);
  ASSERT_TRUE(service_->Discard(*session_, ids).ok());
  EXPECT_TRUE(service_->Stat(*session_, ids)->at(0).resident.contains(TierKind::kHost));
  Write(*session_, ids, 2);
  EXPECT_TRUE(Check(*session_, ids, 2, {kMiB}));
}

TEST_F(ChunkServiceNvmeTest, DiscardRefusesWhatItMayNotDropAndThenDiscardsNothing) {
  auto ids = Alloc(*session_, {kMiB, kMiB}, TierKind::kNvme);
  const std::vector<ChunkId> dead = {ids[0]}, live = {ids[1]};
  Write(*session_, ids, 1);

  // One of the batch acquired for write: its writer may be writing now.
  auto writing = service_->Acquire(*session_, live, TierKind::kHost, Access::kWrite);
  ASSERT_TRUE(writing.ok()) << writing.status();
  absl::Status s = service_->Discard(*session_, ids);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("acquired for write"), std::string::npos) << s;
  ASSERT_TRUE(service_->Release(*session_, live).ok());

  // A persistent chunk outlives sessions: its contents are kept until it is freed.
  std::vector<ChunkRequest> p = {{.size = kMiB, .name = "job/m", .persistent = true}};
  auto kept = *service_->Allocate(*session_, p);
  s = service_->Discard(*session_, std::vector<ChunkId>{ids[0], kept[0]});
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("persistent"), std::string::npos) << s;

  // Another session's chunk, an unknown id, an empty batch.
  auto other = *sessions_.Open({1001, 1001, 2}, "other");
  EXPECT_TRUE(absl::IsPermissionDenied(service_->Discard(*other, dead)));
  EXPECT_TRUE(absl::IsNotFound(service_->Discard(*session_, std::vector<ChunkId>{ids[0], 999999})));
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Discard(*session_, std::vector<ChunkId>{})));

  // None of the refusals dropped anything: both chunks' data reach NVMe and come back.
  const std::vector<ChunkMeta> stat = *service_->Stat(*session_, ids);
  for (const ChunkMeta& c : stat) EXPECT_FALSE(c.dirty.empty()) << "chunk " << c.id;
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_TRUE(Check(*session_, ids, 1, {kMiB, kMiB}));
}

}  // namespace
}  // namespace tierd::daemon
