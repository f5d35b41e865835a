// SharedBases on its own, over a real host tier and ledgers: what it decides, what it reserves, and
// which chunks it hands back for the service to retire. chunk_service_bases_test.cc has the same
// rules through the service, with the chunks made and retired.
#include "daemon/chunks/shared_bases.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "daemon/tiers/host/host_memory.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000, kBob = 2000, kTeam = 500;

class SharedBasesTest : public testing::Test {
 protected:
  SharedBasesTest()
      : host_(std::move(*CreateHostPool({.capacity = 4 * kSeg,
                                         .segment_size = kSeg,
                                         .huge_pages = HugePagePolicy::kNever,
                                         .lock_memory = false}))),
        tiers_(NodeTiers(host_.get())),
        space_(chunks_, ledger_, tiers_, clock_),
        bases_(chunks_, ledger_sessions_, space_, ledger_) {
    bases_.set_share_groups({kTeam});
    alice_ = *registry_.Open({kAlice, kAlice, 1, {kTeam}}, "alice");
    alice2_ = *registry_.Open({kAlice, kAlice, 2}, "alice-second-job");
    bob_ = *registry_.Open({kBob, kBob, 3, {kTeam}}, "bob");
  }

  static BaseRequest Request(std::vector<uint64_t> sizes) {
    BaseRequest r;
    r.sizes = std::move(sizes);
    r.homes.assign(r.sizes.size(), TierKind::kHost);
    r.descriptor = "layout-1";
    return r;
  }

  // What the service does with an Opening: a chunk for each reserved placement, attached.
  Base& Make(const SharedBases::Opening& opening, const BaseRequest& request) {
    for (size_t i = 0; i < opening.to_make.size(); ++i) {
      ChunkMeta& chunk = chunks_.Insert(opening.base->creator, "", /*persistent=*/false);
      chunk.size = request.sizes[i];
      chunk.home = opening.to_make[i].tier;
      chunk.placement[chunk.home] = opening.to_make[i];
      chunk.allocated.insert(chunk.home);
      chunk.resident.insert(chunk.home);
      chunks_.Reindex(chunk);
      bases_.Attach(*opening.base, chunk);
    }
    return *opening.base;
  }

  // Alice makes and seals "llama@1" of two chunks, shared with the team.
  Base& Publish() {
    BaseRequest r = Request({4096, 8192});
    r.group = kTeam;
    absl::StatusOr<SharedBases::Opening> opening = bases_.Open(*alice_, "llama@1", &r, 0);
    EXPECT_TRUE(opening.ok()) << opening.status();
    Base& base = Make(*opening, r);
    EXPECT_TRUE(bases_.Seal(*alice_, "llama@1", "").ok());
    return base;
  }

  std::unique_ptr<SegmentPool> host_;
  const Tiers tiers_;
  FakeClock clock_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  SessionLedger ledger_sessions_;
  Space space_;
  SharedBases bases_;
  SessionRegistry registry_;
  std::shared_ptr<Session> alice_, alice2_, bob_;
};

TEST_F(SharedBasesTest, ANewBaseReservesEveryChunkInOrderAndCountsThemAgainstItsCreator) {
  const BaseRequest r = Request({4096, 8192, 4096});
  absl::StatusOr<SharedBases::Opening> opening = bases_.Open(*alice_, "llama@1", &r, 0);
  ASSERT_TRUE(opening.ok()) << opening.status();
  ASSERT_EQ(opening->to_make.size(), 3u);
  for (const Placement& p : opening->to_make) EXPECT_EQ(p.tier, TierKind::kHost);
  EXPECT_EQ(ledger_.UsageOf(kAlice).chunks, 3u);

  Base& base = Make(*opening, r);
  const OpenedBase opened = bases_.Opened(base, /*created=*/true);
  EXPECT_EQ(opened.sizes, r.sizes);
  EXPECT_EQ(opened.creator, kAlice);
  for (ChunkId id : opened.chunks) {
    EXPECT_EQ(chunks_.at(id).base, base.id);
    EXPECT_TRUE(chunks_.at(id).base_segments);  // others read it: segments of its own
  }
}

TEST_F(SharedBasesTest, AReservationThatFailsLeavesNoBaseAndNoSpaceTaken) {
  // Five segments' worth in a tier of four.
  const BaseRequest r = Request({kSeg, kSeg, kSeg, kSeg, kSeg});
  absl::StatusOr<SharedBases::Opening> opening = bases_.Open(*alice_, "too-big", &r, 0);
  EXPECT_EQ(opening.status().code(), absl::StatusCode::kResourceExhausted) << opening.status();
  EXPECT_EQ(bases_.size(), 0u);
  EXPECT_EQ(ledger_.UsageOf(kAlice).bytes[TierKind::kHost], 0u);
  EXPECT_EQ(ledger_.UsageOf(kAlice).chunks, 0u);
  EXPECT_EQ(bases_.Open(*alice_, "too-big", nullptr, 0).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(SharedBasesTest, ItsChunksComeBackOnlyWhenTheLastHoldGoes) {
  Base& base = Publish();
  const std::vector<ChunkId> chunks = base.chunks;
  ASSERT_TRUE(bases_.Open(*bob_, "llama@1", nullptr, 0).ok());

  absl::StatusOr<std::vector<ChunkId>> gone = bases_.Release(*alice_, "llama@1");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_TRUE(gone->empty());  // bob still holds it
  EXPECT_EQ(bases_.LeaveAll(bob_->id), chunks);
  EXPECT_EQ(bases_.size(), 0u);
}

TEST_F(SharedBasesTest, APinnedBaseOutlivesItsHoldersUntilUnpinned) {
  const std::vector<ChunkId> chunks = Publish().chunks;
  absl::StatusOr<std::vector<ChunkId>> pinned = bases_.Pin(*alice_, "llama@1", true);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE(pinned->empty());
  EXPECT_TRUE(bases_.LeaveAll(alice_->id).empty());
  EXPECT_EQ(bases_.size(), 1u);

  EXPECT_EQ(bases_.Pin(*bob_, "llama@1", false).status().code(),
            absl::StatusCode::kPermissionDenied);  // not its creator
  absl::StatusOr<std::vector<ChunkId>> unpinned = bases_.Pin(*alice2_, "llama@1", false);
  ASSERT_TRUE(unpinned.ok()) << unpinned.status();
  EXPECT_EQ(*unpinned, chunks);
  EXPECT_EQ(bases_.size(), 0u);
}

TEST_F(SharedBasesTest, ALoaderThatLeavesBeforeSealingTakesTheBaseWithIt) {
  const BaseRequest r = Request({4096});
  absl::StatusOr<SharedBases::Opening> opening = bases_.Open(*alice_, "half", &r, 0);
  ASSERT_TRUE(opening.ok()) << opening.status();
  const Base& base = Make(*opening, r);
  const BaseId id = base.id;
  const std::vector<ChunkId> chunks = base.chunks;
  EXPECT_EQ(bases_.NameOf(id), "half");
  EXPECT_EQ(bases_.Open(*alice2_, "half", nullptr, 0).status().code(),
            absl::StatusCode::kUnavailable);  // being loaded
  EXPECT_EQ(bases_.LeaveAll(alice_->id), chunks);
  EXPECT_EQ(bases_.NameOf(id), "");
}

TEST_F(SharedBasesTest, OnlyAHolderMapsItsSegmentsAndOnlyTheLoaderForWriting) {
  const BaseRequest r = Request({4096});
  absl::StatusOr<SharedBases::Opening> opening = bases_.Open(*alice_, "llama@1", &r, 0);
  ASSERT_TRUE(opening.ok()) << opening.status();
  Base& base = Make(*opening, r);
  const uint32_t owner = SegmentOwnerOfBase(base.id);
  EXPECT_EQ(bases_.MayMapSegment(*alice_, owner).value_or(false), true);  // loading: writes
  EXPECT_EQ(bases_.MayMapSegment(*bob_, owner).status().code(),
            absl::StatusCode::kPermissionDenied);  // holds nothing
  ASSERT_TRUE(bases_.Seal(*alice_, "llama@1", "").ok());
  EXPECT_EQ(bases_.MayMapSegment(*alice_, owner).value_or(true), false);  // sealed: reads
  EXPECT_EQ(bases_.MayMapSegment(*alice_, kAlice).status().code(),
            absl::StatusCode::kPermissionDenied);  // a user's segments are no base's
}

TEST_F(SharedBasesTest, ASealedBasesChunksAreReadInTheHostAndNvmeTiersOnly) {
  const ChunkMeta& chunk = chunks_.at(Publish().chunks.front());
  EXPECT_TRUE(bases_.CheckUse(*alice_, chunk, TierKind::kHost, Access::kRead).ok());
  EXPECT_EQ(bases_.CheckUse(*alice_, chunk, TierKind::kHost, Access::kWrite).code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(bases_.CheckUse(*alice_, chunk, TierKind::kDevice, Access::kRead).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(bases_.CheckHeld(chunk, *bob_).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(bases_.CheckHeld(chunk, *alice_).ok());
}

}  // namespace
}  // namespace tierd::daemon
