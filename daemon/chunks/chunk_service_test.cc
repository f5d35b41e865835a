// The chunk service's rules: ownership, whole-batch validation, names, and session end.
#include "daemon/chunks/chunk_service.h"

#include "daemon/tiers/extent_allocator.h"
#include "daemon/tiers/host/host_memory.h"

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;

class ChunkServiceTest : public testing::Test {
 protected:
  void SetUp() override {
    HostPoolOptions o{.capacity = 4 * kSeg,
                      .segment_size = kSeg,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    pool_ = std::move(*CreateHostPool(o));
    service_ = std::make_unique<ChunkService>(NodeTiers(pool_.get()));
    alice_ = *sessions_.Open({1000, 1000, 1}, "alice");
    alice2_ = *sessions_.Open({1000, 1000, 2}, "alice-second-rank");
    bob_ = *sessions_.Open({2000, 2000, 3}, "bob");
  }

  std::vector<ChunkId> Alloc(const Session& s, std::vector<uint64_t> sizes) {
    std::vector<ChunkRequest> r;
    for (uint64_t size : sizes) r.push_back({.size = size});
    auto ids = service_->Allocate(s, r);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<ChunkId>{};
  }

  uint64_t Used() const { return pool_->Usage().used_bytes; }

  std::unique_ptr<SegmentPool> pool_;
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> alice_, alice2_, bob_;
};

TEST_F(ChunkServiceTest, AllocateReturnsIdsInRequestOrderWithHostPlacements) {
  auto ids = Alloc(*alice_, {4096, 8192, 1 << 20});
  ASSERT_EQ(ids.size(), 3u);
  auto acquired = service_->Acquire(*alice_, ids, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(acquired.ok()) << acquired.status();
  ASSERT_EQ(acquired->locations.size(), 3u);
  EXPECT_EQ(acquired->locations[2].size, 1u << 20);
  for (const Placement& p : acquired->locations) EXPECT_EQ(p.offset % 4096, 0u);
}

TEST_F(ChunkServiceTest, OtherSessionOfTheSameUserCannotTouchScratchChunks) {
  auto ids = Alloc(*alice_, {4096});
  EXPECT_TRUE(absl::IsPermissionDenied(
      service_->Acquire(*alice2_, ids, TierKind::kHost, Access::kRead).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(service_->Free(*alice2_, ids)));
  EXPECT_TRUE(absl::IsPermissionDenied(service_->Stat(*alice2_, ids).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(service_->Release(*alice2_, ids)));
  EXPECT_TRUE(
      absl::IsPermissionDenied(service_->Prefetch(*alice2_, ids, TierKind::kHost, 0).status()));
  EXPECT_EQ(service_->chunk_count(), 1u);
}

TEST_F(ChunkServiceTest, UnknownChunkIsNotFound) {
  absl::Status s = service_->Free(*alice_, std::vector<ChunkId>{12345});
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_NE(s.message().find("chunk 12345"), std::string::npos);
}

TEST_F(ChunkServiceTest, BatchWithOneBadEntryChangesNothing) {
  auto before = Used();
  std::vector<ChunkRequest> r = {{.size = 4096}, {.size = 0}, {.size = 4096}};
  absl::Status s = service_->Allocate(*alice_, r).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("chunk #1"), std::string::npos) << s;
  EXPECT_EQ(Used(), before);
  EXPECT_EQ(service_->chunk_count(), 0u);

  auto ids = Alloc(*alice_, {4096, 4096});
  std::vector<ChunkId> with_unknown = {ids[0], 999999, ids[1]};
  EXPECT_TRUE(absl::IsNotFound(service_->Free(*alice_, with_unknown)));
  EXPECT_EQ(service_->chunk_count(), 2u);
  std::vector<ChunkId> duplicate = {ids[0], ids[0]};
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Free(*alice_, duplicate)));
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Free(*alice_, std::vector<ChunkId>{})));
  EXPECT_EQ(service_->chunk_count(), 2u);
}

TEST_F(ChunkServiceTest, TierFullRollsBackTheWholeBatch) {
  auto before = Used();
  // Four segments of 4 MiB: five 4 MiB chunks cannot fit; the first four must be given back.
  std::vector<ChunkRequest> r(5, ChunkRequest{.size = kSeg});
  absl::Status s = service_->Allocate(*alice_, r).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("chunk #4"), std::string::npos) << s;
  EXPECT_EQ(Used(), before);
  EXPECT_EQ(service_->chunk_count(), 0u);
  r.pop_back();
  EXPECT_TRUE(service_->Allocate(*alice_, r).ok());
}

TEST_F(ChunkServiceTest, AbsurdSizeAndUnconfiguredTierAreRejected) {
  std::vector<ChunkRequest> huge = {{.size = 1ull << 50}};
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Allocate(*alice_, huge).status()));
  std::vector<ChunkRequest> nvme = {{.size = 4096, .home = TierKind::kNvme}};
  absl::Status s = service_->Allocate(*alice_, nvme).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("nvme tier is not configured"), std::string::npos) << s;
  auto ids = Alloc(*alice_, {4096});
  EXPECT_TRUE(
      absl::IsFailedPrecondition(service_->Prefetch(*alice_, ids, TierKind::kDevice, 0).status()));
  // A transient chunk's contents are wanted briefly: it cannot outlive the session.
  std::vector<ChunkRequest> kept = {
      {.size = 4096, .name = "grads", .persistent = true, .transient = true}};
  s = service_->Allocate(*alice_, kept).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("transient"), std::string::npos) << s;
  std::vector<ChunkRequest> brief = {{.size = 4096, .transient = true}};
  auto made = service_->Allocate(*alice_, brief);
  ASSERT_TRUE(made.ok()) << made.status();
}

TEST_F(ChunkServiceTest, FreeWhileAcquiredFailsUntilReleased) {
  auto ids = Alloc(*alice_, {4096});
  ASSERT_TRUE(service_->Acquire(*alice_, ids, TierKind::kHost, Access::kWrite).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Free(*alice_, ids)));
  ASSERT_TRUE(service_->Release(*alice_, ids).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Release(*alice_, ids)));  // not acquired
  EXPECT_TRUE(service_->Free(*alice_, ids).ok());
  EXPECT_EQ(Used(), 0u);
}

TEST_F(ChunkServiceTest, NamesAreValidatedAndUniquePerUser) {
  for (const char* bad : {"", "a//b", "/abs", "a/../b", "sp ace", "semi;colon", "a/./b"}) {
    std::vector<ChunkRequest> r = {{.size = 4096, .name = bad, .persistent = true}};
    EXPECT_TRUE(absl::IsInvalidArgument(service_->Allocate(*alice_, r).status())) << bad;
  }
  std::vector<ChunkRequest> r = {{.size = 4096, .name = "job42/opt/m/layer17"}};
  ASSERT_TRUE(service_->Allocate(*alice_, r).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(service_->Allocate(*alice2_, r).status()));
  EXPECT_TRUE(service_->Allocate(*bob_, r).ok());  // another user's namespace
}

TEST_F(ChunkServiceTest, PersistentChunkNeedsANameAndOutlivesItsSession) {
  std::vector<ChunkRequest> unnamed = {{.size = 4096, .persistent = true}};
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Allocate(*alice_, unnamed).status()));

  std::vector<ChunkRequest> r = {{.size = 8192, .name = "job/m", .persistent = true},
                                 {.size = 4096}};
  auto ids = *service_->Allocate(*alice_, r);
  EXPECT_EQ(service_->CloseSession(*alice_), 1u);  // the scratch chunk only
  EXPECT_EQ(service_->chunk_count(), 1u);

  // Another session of the same user opens it by name; another user cannot.
  std::vector<ChunkRequest> open = {
      {.size = 8192, .name = "job/m", .persistent = true, .open_existing = true}};
  auto reopened = service_->Allocate(*alice2_, open);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)[0], ids[0]);
  EXPECT_TRUE(service_->Acquire(*alice2_, *reopened, TierKind::kHost, Access::kRead).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(
      service_->Acquire(*bob_, *reopened, TierKind::kHost, Access::kRead).status()));
  std::vector<ChunkRequest> wrong_size = {
      {.size = 4096, .name = "job/m", .persistent = true, .open_existing = true}};
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Allocate(*alice2_, wrong_size).status()));
}

TEST_F(ChunkServiceTest, OpeningANameThatIsNotThereIsNotFoundNotAFreshChunk) {
  std::vector<ChunkRequest> open = {{.size = 4096,
                                     .name = "run-42/adam/m",
                                     .persistent = true,
                                     .open_existing = true,
                                     .must_exist = true}};
  absl::Status s = service_->Allocate(*alice_, open).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("run-42/adam/m"), std::string::npos) << s;
  EXPECT_EQ(service_->chunk_count(), 0u);
  // must_exist means nothing without open_existing.
  std::vector<ChunkRequest> odd = {
      {.size = 4096, .name = "x", .persistent = true, .must_exist = true}};
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Allocate(*alice_, odd).status()));
  // Created, it opens.
  std::vector<ChunkRequest> create = {{.size = 4096, .name = "run-42/adam/m", .persistent = true}};
  auto made = *service_->Allocate(*alice_, create);
  EXPECT_EQ(service_->CloseSession(*alice_), 0u);
  auto opened = service_->Allocate(*alice2_, open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)[0], made[0]);
}

TEST_F(ChunkServiceTest, APersistentChunkALiveSessionHoldsIsNeitherOpenedNorFreedByAnother) {
  std::vector<ChunkRequest> create = {{.size = 4096, .name = "adam", .persistent = true}};
  auto held = *service_->Allocate(*alice_, create);
  std::vector<ChunkRequest> open = {
      {.size = 4096, .name = "adam", .persistent = true, .open_existing = true}};
  // The same user's second job: refused, naming the holder.
  absl::Status s = service_->Allocate(*alice2_, open).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find(alice_->Describe()), std::string::npos) << s;
  // Nor can it free (reset) the state under the holder.
  s = service_->Free(*alice2_, held);
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("freed"), std::string::npos) << s;
  EXPECT_EQ(service_->chunk_count(), 1u);
  // Opening it again in the holding session is fine.
  EXPECT_TRUE(service_->Allocate(*alice_, open).ok());
  // Once the holder ends, the next job opens it, and then holds it.
  service_->CloseSession(*alice_);
  auto opened = service_->Allocate(*alice2_, open);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)[0], held[0]);
  EXPECT_TRUE(service_->Free(*alice2_, held).ok());
}

TEST_F(ChunkServiceTest, SessionsThatBothAskToShareAPersistentChunkShareIt) {
  std::vector<ChunkRequest> create = {
      {.size = 4096, .name = "shared", .persistent = true, .shared = true}};
  auto made = *service_->Allocate(*alice_, create);
  std::vector<ChunkRequest> open_shared = {
      {.size = 4096, .name = "shared", .persistent = true, .open_existing = true, .shared = true}};
  std::vector<ChunkRequest> open_alone = {
      {.size = 4096, .name = "shared", .persistent = true, .open_existing = true}};
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Allocate(*alice2_, open_alone).status()));
  auto opened = service_->Allocate(*alice2_, open_shared);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)[0], made[0]);
  // Each holder's holdings count it (as tierctl status shows them).
  const std::map<SessionId, SessionHoldings> held = service_->Holdings();
  EXPECT_EQ(held.at(alice_->id).chunks, 1u);
  EXPECT_EQ(held.at(alice2_->id).bytes, 4096u);
  // Neither can free it while the other holds it.
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Free(*alice_, made)));
  service_->CloseSession(*alice_);
  EXPECT_TRUE(service_->Free(*alice2_, made).ok());
}

TEST_F(ChunkServiceTest, SessionEndReleasesPinsAndFreesScratchChunks) {
  auto ids = Alloc(*alice_, {4096, 1 << 20});
  std::vector<ChunkRequest> p = {{.size = 4096, .name = "keep", .persistent = true}};
  auto kept = *service_->Allocate(*alice_, p);
  ASSERT_TRUE(service_->Acquire(*alice_, ids, TierKind::kHost, Access::kWrite).ok());
  ASSERT_TRUE(service_->Acquire(*alice_, kept, TierKind::kHost, Access::kWrite).ok());
  EXPECT_EQ(service_->CloseSession(*alice_), 2u);
  EXPECT_EQ(Used(), 4096u);
  auto stat = service_->Stat(*alice2_, kept);
  ASSERT_TRUE(stat.ok());
  EXPECT_EQ((*stat)[0].pins, 0u);   // the dead session's pin is gone
  EXPECT_EQ((*stat)[0].owner, 0u);  // detached
  // Requests that raced with the end change nothing.
  std::vector<ChunkRequest> late = {{.size = 4096}};
  EXPECT_TRUE(absl::IsUnavailable(service_->Allocate(*alice_, late).status()));
  EXPECT_EQ(service_->chunk_count(), 1u);
}

TEST_F(ChunkServiceTest, ListPagesThroughOwnAndPersistentChunksInIdOrder) {
  auto mine = Alloc(*alice_, {4096, 4096, 4096});
  Alloc(*alice2_, {4096});
  std::vector<ChunkRequest> p = {{.size = 4096, .name = "shared", .persistent = true}};
  auto persistent = *service_->Allocate(*alice2_, p);
  ChunkPage first = service_->List(*alice_, 0, 2);
  ASSERT_EQ(first.chunks.size(), 2u);
  EXPECT_EQ(first.chunks[0].id, mine[0]);
  EXPECT_NE(first.next_page_token, 0u);
  ChunkPage rest = service_->List(*alice_, first.next_page_token, 10);
  ASSERT_EQ(rest.chunks.size(), 2u);
  EXPECT_EQ(rest.chunks[0].id, mine[2]);
  EXPECT_EQ(rest.chunks[1].id, persistent[0]);
  EXPECT_EQ(rest.next_page_token, 0u);
  EXPECT_EQ(service_->List(*bob_, 0, 10).chunks.size(), 0u);
}

TEST_F(ChunkServiceTest, EvictToTheHomeTierCompletesAndUpwardEvictIsInvalid) {
  auto ids = Alloc(*alice_, {4096});
  auto token = service_->Evict(*alice_, ids, TierKind::kHost);
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(
      service_->Evict(*alice_, ids, TierKind::kDevice).status()));  // not configured
}

TEST_F(ChunkServiceTest, ManyChunksFitTheMetadataBudget) {
  // 100k chunks of one page each in 16 MiB would not fit; use 4 KiB chunks in one user's 4
  // segments.
  std::vector<ChunkRequest> r(4000, ChunkRequest{.size = 4096});
  auto ids = service_->Allocate(*alice_, r);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(service_->chunk_count(), 4000u);
  EXPECT_TRUE(service_->Free(*alice_, *ids).ok());
  EXPECT_EQ(Used(), 0u);
}

// A tier that only hands out address space: the chunk table at a million chunks without the 4 GiB
// of memory a million host-tier pages would pin.
class AddressSpaceTier final : public Tier {
 public:
  TierKind kind() const override { return TierKind::kHost; }
  uint64_t max_reservation() const override { return 1ull << 30; }
  absl::StatusOr<Placement> Reserve(uint32_t, uint64_t size) override {
    auto offset = space_.Allocate(size);
    if (!offset) return absl::ResourceExhaustedError("address space full");
    return Placement{TierKind::kHost, 0, 1, *offset, space_.RoundUp(size)};
  }
  void Unreserve(const Placement& p) override { space_.Free(p.offset, p.size); }
  TierUsage Usage() const override { return {space_.capacity(), space_.used_bytes(), 0}; }
  std::string Describe() const override { return "address space"; }

 private:
  ExtentAllocator space_{1ull << 40, 4096};
};

TEST(ChunkTableScaleTest, HoldsAMillionChunks) {
  AddressSpaceTier tier;
  ChunkService service(NodeTiers(&tier));
  SessionRegistry sessions;
  auto session = *sessions.Open({1000, 1000, 1}, "scale");
  constexpr size_t kBatch = 100'000;
  std::vector<ChunkRequest> r(kBatch, ChunkRequest{.size = 4096});
  std::vector<ChunkId> all;
  for (int i = 0; i < 10; ++i) {
    auto ids = service.Allocate(*session, r);
    ASSERT_TRUE(ids.ok()) << ids.status();
    all.insert(all.end(), ids->begin(), ids->end());
  }
  EXPECT_EQ(service.chunk_count(), 1'000'000u);
  auto acquired = service.Acquire(*session, std::span<const ChunkId>(all).subspan(500'000, kBatch),
                                  TierKind::kHost, Access::kWrite);
  ASSERT_TRUE(acquired.ok()) << acquired.status();
  ChunkPage last = service.List(*session, all[999'990], 100);
  EXPECT_EQ(last.chunks.size(), 10u);
  EXPECT_TRUE(
      service.Release(*session, std::span<const ChunkId>(all).subspan(500'000, kBatch)).ok());
  for (size_t i = 0; i < all.size(); i += kBatch) {
    ASSERT_TRUE(service.Free(*session, std::span<const ChunkId>(all).subspan(i, kBatch)).ok());
  }
  EXPECT_EQ(service.chunk_count(), 0u);
  EXPECT_EQ(tier.Usage().used_bytes, 0u);
}

}  // namespace
}  // namespace tierd::daemon
