// The chunk state machine (docs/architecture.md, "Chunk states").
#include "daemon/chunks/chunk.h"

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

ChunkMeta HostChunk() {
  ChunkMeta c;
  c.id = 7;
  c.size = 4096;
  c.home = TierKind::kHost;
  c.resident.insert(TierKind::kHost);
  return c;
}

TEST(ChunkStateTest, ReadyResidentChunkCanBePinnedAndUnpinned) {
  ChunkMeta c = HostChunk();
  ASSERT_TRUE(CheckPin(c, TierKind::kHost).ok());
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kRead);
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kRead);
  EXPECT_EQ(c.pins, 2u);
  Unpin(c);
  Unpin(c);
  EXPECT_EQ(c.pins, 0u);
}

TEST(ChunkStateTest, PinInATierWithoutACopyIsRefused) {
  ChunkMeta c = HostChunk();
  absl::Status s = CheckPin(c, TierKind::kDevice);
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_NE(s.message().find("chunk 7 is not resident in the device tier"), std::string::npos);
}

TEST(ChunkStateTest, WriteAboveTheHomeTierMarksThatCopyDirty) {
  ChunkMeta c = HostChunk();
  c.home = TierKind::kNvme;
  c.resident.insert(TierKind::kNvme);
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kWrite);
  EXPECT_TRUE(c.dirty.contains(TierKind::kHost));
  EXPECT_FALSE(c.dirty.contains(TierKind::kNvme));
}

TEST(ChunkStateTest, WriteToTheHomeCopyIsNotDirty) {
  ChunkMeta c = HostChunk();
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kWrite);
  EXPECT_TRUE(c.dirty.empty());
}

TEST(ChunkStateTest, FreeWhilePinnedIsRefused) {
  ChunkMeta c = HostChunk();
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kRead);
  absl::Status s = CheckFreeable(c);
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_NE(s.message().find("acquired"), std::string::npos);
  Unpin(c);
  EXPECT_TRUE(CheckFreeable(c).ok());
}

// Freed while moving, it ends when the move settles (ChunkService::Retire).
TEST(ChunkStateTest, MovingChunkCanBeNeitherPinnedNorMovedAgainButCanBeFreed) {
  ChunkMeta c = HostChunk();
  ASSERT_TRUE(BeginMove(c, TierKind::kNvme).ok());
  EXPECT_EQ(c.state, ChunkState::kMoving);
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckPin(c, TierKind::kHost)));
  EXPECT_TRUE(CheckFreeable(c).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(BeginMove(c, TierKind::kDevice)));
  Hold(c);
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckFreeable(c)));
}

TEST(ChunkStateTest, SuccessfulMoveAddsTheTargetCopy) {
  ChunkMeta c = HostChunk();
  ASSERT_TRUE(BeginMove(c, TierKind::kNvme).ok());
  FinishMove(c, /*ok=*/true);
  EXPECT_EQ(c.state, ChunkState::kReady);
  EXPECT_TRUE(c.resident.contains(TierKind::kNvme));
  EXPECT_TRUE(c.resident.contains(TierKind::kHost));
}

TEST(ChunkStateTest, FailedMoveLeavesTheChunkAsItWas) {
  ChunkMeta c = HostChunk();
  ASSERT_TRUE(BeginMove(c, TierKind::kNvme).ok());
  FinishMove(c, /*ok=*/false);
  EXPECT_EQ(c.state, ChunkState::kReady);
  EXPECT_FALSE(c.resident.contains(TierKind::kNvme));
}

TEST(ChunkStateTest, ChunkWithNoValidCopyCannotMove) {
  ChunkMeta c = HostChunk();
  c.resident.erase(TierKind::kHost);
  EXPECT_TRUE(absl::IsDataLoss(BeginMove(c, TierKind::kNvme)));
}

}  // namespace
}  // namespace tierd::daemon

namespace tierd::daemon {
namespace {

TEST(ChunkStateTest, WriteMakesTheAcquiredCopyTheOnlyValidOne) {
  ChunkMeta c;
  c.id = 9;
  c.home = TierKind::kNvme;
  c.resident.insert(TierKind::kNvme);
  c.resident.insert(TierKind::kHost);
  Hold(c);
  ApplyAccess(c, TierKind::kHost, Access::kWrite);
  EXPECT_TRUE(c.resident.contains(TierKind::kHost));
  EXPECT_FALSE(c.resident.contains(TierKind::kNvme));  // stale from now on
  Unpin(c);
  // Writing it home makes it clean again.
  ASSERT_TRUE(BeginMove(c, TierKind::kNvme).ok());
  FinishMove(c, true);
  EXPECT_TRUE(c.dirty.empty());
  EXPECT_TRUE(c.resident.contains(TierKind::kNvme));
}

}  // namespace
}  // namespace tierd::daemon
