// Shared bases: one read-only copy opened by every session its creator allows, charged to the
// creator, gone with its last holder.
#include "daemon/chunks/chunk_service.h"

#include "daemon/tiers/host/host_memory.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 4 << 20;
constexpr uint32_t kAlice = 1000, kBob = 2000, kCarol = 3000, kTeam = 500;

class ChunkServiceBasesTest : public testing::Test {
 protected:
  void SetUp() override {
    HostPoolOptions o{.capacity = 4 * kSeg,
                      .segment_size = kSeg,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    pool_ = std::move(*CreateHostPool(o));
    service_ = std::make_unique<ChunkService>(NodeTiers(pool_.get()));
    service_->set_base_groups({kTeam});
    alice_ = *sessions_.Open({kAlice, kAlice, 1, {kTeam}}, "alice");
    alice2_ = *sessions_.Open({kAlice, kAlice, 2}, "alice-second-job");
    bob_ = *sessions_.Open({kBob, kBob, 3, {kTeam}}, "bob");
    carol_ = *sessions_.Open({kCarol, kCarol, 4}, "carol");
  }

  BaseRequest Request(std::vector<uint64_t> sizes, std::string descriptor = "layout-1") {
    BaseRequest r;
    r.sizes = sizes;
    r.homes.assign(sizes.size(), TierKind::kHost);
    r.descriptor = std::move(descriptor);
    return r;
  }

  // Alice makes and seals "llama@1" of two chunks (shared with the team when `team`).
  OpenedBase Publish(bool team = false) {
    BaseRequest r = Request({4096, 8192});
    if (team) r.group = kTeam;
    absl::StatusOr<OpenedBase> made = service_->OpenBase(*alice_, "llama@1", &r);
    EXPECT_TRUE(made.ok()) << made.status();
    EXPECT_TRUE(made->created);
    EXPECT_TRUE(service_->SealBase(*alice_, "llama@1").ok());
    return *made;
  }

  std::unique_ptr<SegmentPool> pool_;
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> alice_, alice2_, bob_, carol_;
};

TEST_F(ChunkServiceBasesTest, AnotherJobOfTheCreatorOpensTheSameChunks) {
  OpenedBase made = Publish();
  absl::StatusOr<OpenedBase> opened = service_->OpenBase(*alice2_, "llama@1", nullptr);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_FALSE(opened->created);
  EXPECT_EQ(opened->chunks, made.chunks);
  EXPECT_EQ(opened->descriptor, "layout-1");
  EXPECT_TRUE(service_->Acquire(*alice2_, opened->chunks, TierKind::kHost, Access::kRead).ok());
}

TEST_F(ChunkServiceBasesTest, TheBaseIsCountedOnceAndChargedToItsCreator) {
  const uint64_t before = pool_->Usage().used_bytes;
  Publish(/*team=*/true);
  const uint64_t after_publish = pool_->Usage().used_bytes;
  ASSERT_TRUE(service_->OpenBase(*alice2_, "llama@1", nullptr).ok());
  ASSERT_TRUE(service_->OpenBase(*bob_, "llama@1", nullptr).ok());
  EXPECT_EQ(pool_->Usage().used_bytes, after_publish);
  EXPECT_GE(after_publish - before, 4096u + 8192u);
  EXPECT_EQ(service_->tenant_usage(kAlice).chunks, 2u);
  EXPECT_EQ(service_->tenant_usage(kBob).chunks, 0u);
  EXPECT_EQ(service_->tenant_usage(kBob).bytes[TierKind::kHost], 0u);
}

TEST_F(ChunkServiceBasesTest, NobodyWritesOrFreesASealedBase) {
  OpenedBase made = Publish();
  for (Access a : {Access::kWrite, Access::kOverwrite}) {
    absl::Status s = service_->Acquire(*alice_, made.chunks, TierKind::kHost, a).status();
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
    EXPECT_NE(s.message().find("read-only"), std::string::npos) << s;
  }
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Free(*alice_, made.chunks)));
  EXPECT_EQ(service_->chunk_count(), 2u);
}

TEST_F(ChunkServiceBasesTest, OnlyTheCreatorOperatorsAndTheSharedGroupOpenIt) {
  Publish(/*team=*/false);
  absl::Status s = service_->OpenBase(*bob_, "llama@1", nullptr).status();
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  EXPECT_NE(s.message().find("not shared"), std::string::npos) << s;
  ASSERT_TRUE(service_->ReleaseBase(*alice_, "llama@1").ok());  // gone: nobody holds it

  Publish(/*team=*/true);
  EXPECT_TRUE(service_->OpenBase(*bob_, "llama@1", nullptr).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(service_->OpenBase(*carol_, "llama@1", nullptr).status()));
  std::shared_ptr<Session> root = *sessions_.Open({0, 0, 9}, "root");
  EXPECT_TRUE(service_->OpenBase(*root, "llama@1", nullptr).ok());
}

TEST_F(ChunkServiceBasesTest, ItsChunksAreNotTheChunksOfThoseWithoutAHold) {
  OpenedBase made = Publish(/*team=*/true);
  // Bob may open it, but has not: its chunk ids alone give him nothing.
  EXPECT_TRUE(absl::IsPermissionDenied(
      service_->Acquire(*bob_, made.chunks, TierKind::kHost, Access::kRead).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(
      service_->MayMapBaseSegment(*bob_, SegmentOwnerOfBase(made.id)).status()));
  ASSERT_TRUE(service_->OpenBase(*bob_, "llama@1", nullptr).ok());
  absl::StatusOr<bool> writable = service_->MayMapBaseSegment(*bob_, SegmentOwnerOfBase(made.id));
  ASSERT_TRUE(writable.ok());
  EXPECT_FALSE(*writable);
}

TEST_F(ChunkServiceBasesTest, ASharedGroupMustBeTheOperatorsAndTheCreators) {
  BaseRequest r = Request({4096});
  r.group = 777;  // not in base_groups
  EXPECT_TRUE(absl::IsPermissionDenied(service_->OpenBase(*alice_, "a", &r).status()));
  r.group = kTeam;  // carol is not in it
  EXPECT_TRUE(absl::IsPermissionDenied(service_->OpenBase(*carol_, "a", &r).status()));
  EXPECT_EQ(service_->chunk_count(), 0u);
}

TEST_F(ChunkServiceBasesTest, PublishingANameThatExistsWithOtherContentsChangesNothing) {
  OpenedBase made = Publish();
  for (BaseRequest r : {Request({4096, 8192}, "layout-2"), Request({4096})}) {
    absl::Status s = service_->OpenBase(*alice2_, "llama@1", &r).status();
    EXPECT_TRUE(absl::IsAlreadyExists(s)) << s;
    EXPECT_NE(s.message().find("other contents"), std::string::npos) << s;
  }
  // The same contents: an open.
  BaseRequest same = Request({4096, 8192});
  absl::StatusOr<OpenedBase> opened = service_->OpenBase(*alice2_, "llama@1", &same);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_FALSE(opened->created);
  EXPECT_EQ(opened->chunks, made.chunks);
}

TEST_F(ChunkServiceBasesTest, ABaseBeingLoadedIsNotOpenedUntilSealed) {
  BaseRequest r = Request({4096});
  absl::StatusOr<OpenedBase> made = service_->OpenBase(*alice_, "b", &r);
  ASSERT_TRUE(made.ok());
  EXPECT_TRUE(absl::IsUnavailable(service_->OpenBase(*alice2_, "b", nullptr).status()));
  absl::StatusOr<AcquireResult> w =
      service_->Acquire(*alice_, made->chunks, TierKind::kHost, Access::kOverwrite);
  ASSERT_TRUE(w.ok()) << w.status();
  // Sealed only once the loader's writes are released; only the loader seals.
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->SealBase(*alice_, "b")));
  ASSERT_TRUE(service_->Release(*alice_, made->chunks).ok());
  EXPECT_FALSE(service_->SealBase(*alice2_, "b").ok());
  ASSERT_TRUE(service_->SealBase(*alice_, "b").ok());
  EXPECT_TRUE(service_->OpenBase(*alice2_, "b", nullptr).ok());
}

TEST_F(ChunkServiceBasesTest, ALoaderThatDiesBeforeSealingLeavesNothing) {
  BaseRequest r = Request({4096, 4096});
  ASSERT_TRUE(service_->OpenBase(*alice_, "b", &r).ok());
  const uint64_t before = 0;
  service_->CloseSession(*alice_);
  EXPECT_EQ(service_->chunk_count(), before);
  EXPECT_EQ(pool_->Usage().used_bytes, 0u);
  EXPECT_TRUE(absl::IsNotFound(service_->OpenBase(*alice2_, "b", nullptr).status()));
}

TEST_F(ChunkServiceBasesTest, TheBaseLivesWhileAJobHoldsItOrItIsPinned) {
  Publish();
  ASSERT_TRUE(service_->OpenBase(*alice2_, "llama@1", nullptr).ok());
  service_->CloseSession(*alice_);  // the creator's job ends (killed: the same)
  EXPECT_EQ(service_->chunk_count(), 2u);
  ASSERT_TRUE(service_->PinBase(*alice2_, "llama@1", true).ok());
  service_->CloseSession(*alice2_);
  EXPECT_EQ(service_->chunk_count(), 2u);  // pinned
  std::vector<BaseStatus> listed = service_->ListBases(*bob_);
  EXPECT_TRUE(listed.empty());  // not shared with bob
  std::shared_ptr<Session> later = *sessions_.Open({kAlice, kAlice, 7}, "later");
  listed = service_->ListBases(*later);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_TRUE(listed[0].pinned);
  EXPECT_TRUE(listed[0].holders.empty());
  EXPECT_EQ(listed[0].bytes, 4096u + 8192u);
  EXPECT_TRUE(absl::IsPermissionDenied(service_->PinBase(*bob_, "llama@1", false)) ||
              absl::IsNotFound(service_->PinBase(*bob_, "llama@1", false)));
  ASSERT_TRUE(service_->PinBase(*later, "llama@1", false).ok());
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(pool_->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceBasesTest, AHolderReleasesItsPinsBeforeItsHold) {
  OpenedBase made = Publish();
  ASSERT_TRUE(service_->Acquire(*alice_, made.chunks, TierKind::kHost, Access::kRead).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->ReleaseBase(*alice_, "llama@1")));
  ASSERT_TRUE(service_->Release(*alice_, made.chunks).ok());
  EXPECT_TRUE(service_->ReleaseBase(*alice_, "llama@1").ok());
  EXPECT_EQ(service_->chunk_count(), 0u);
}

TEST_F(ChunkServiceBasesTest, AKilledHolderWithPinsLetsGoOfEverything) {
  OpenedBase made = Publish();
  ASSERT_TRUE(service_->OpenBase(*alice2_, "llama@1", nullptr).ok());
  ASSERT_TRUE(service_->Acquire(*alice2_, made.chunks, TierKind::kHost, Access::kRead).ok());
  service_->CloseSession(*alice2_);
  service_->CloseSession(*alice_);
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(pool_->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceBasesTest, BadRequestsAreRefusedWithNothingMade) {
  BaseRequest empty = Request({});
  EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, "b", &empty).status()));
  BaseRequest zero = Request({0});
  EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, "b", &zero).status()));
  BaseRequest huge = Request({kSeg + 1});
  EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, "b", &huge).status()));
  BaseRequest device = Request({4096});
  device.homes[0] = TierKind::kDevice;
  EXPECT_FALSE(service_->OpenBase(*alice_, "b", &device).ok());
  BaseRequest fine = Request({4096});
  for (const char* name : {"", "a//b", "/a", "a b", "a\n"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, name, &fine).status())) << name;
  }
  BaseRequest big = Request({4096}, std::string(kMaxBaseDescriptorBytes + 1, 'x'));
  EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, "b", &big).status()));
  BaseRequest full = Request({kSeg, kSeg, kSeg, kSeg, kSeg});  // more than the tier
  EXPECT_TRUE(absl::IsResourceExhausted(service_->OpenBase(*alice_, "b", &full).status()));
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(pool_->Usage().used_bytes, 0u);
  EXPECT_TRUE(service_->ListBases(*alice_).empty());
  EXPECT_TRUE(absl::IsNotFound(service_->OpenBase(*alice_, "b", nullptr).status()));
}

TEST_F(ChunkServiceBasesTest, ItsSegmentsHoldNothingElse) {
  OpenedBase made = Publish();
  std::vector<ChunkRequest> r = {{.size = 4096}};
  absl::StatusOr<std::vector<ChunkId>> own = service_->Allocate(*alice_, r);
  ASSERT_TRUE(own.ok());
  absl::StatusOr<AcquireResult> base =
      service_->Acquire(*alice_, made.chunks, TierKind::kHost, Access::kRead);
  absl::StatusOr<AcquireResult> mine =
      service_->Acquire(*alice_, *own, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(base.ok() && mine.ok());
  EXPECT_NE(base->locations[0].segment, mine->locations[0].segment);
  EXPECT_EQ(pool_->OwnerOf(base->locations[0].segment), SegmentOwnerOfBase(made.id));
  EXPECT_EQ(pool_->OwnerOf(mine->locations[0].segment), kAlice);
}

TEST_F(ChunkServiceBasesTest, AJobsRanksWriteTheirBaseAndNobodyElseDoes) {
  std::shared_ptr<Session> rank0 = *sessions_.Open({kAlice, kAlice, 11}, "rank0", "run-7");
  std::shared_ptr<Session> rank1 = *sessions_.Open({kAlice, kAlice, 12}, "rank1", "run-7");
  std::shared_ptr<Session> other_job = *sessions_.Open({kAlice, kAlice, 13}, "x", "run-8");
  std::shared_ptr<Session> other_user = *sessions_.Open({kBob, kBob, 14}, "y", "run-7");
  BaseRequest r = Request({4096, 4096});
  r.job_writable = true;
  absl::StatusOr<OpenedBase> made = service_->OpenBase(*rank0, "ranks/llama", &r);
  ASSERT_TRUE(made.ok()) << made.status();
  ASSERT_TRUE(service_->SealBase(*rank0, "ranks/llama").ok());
  absl::StatusOr<OpenedBase> opened = service_->OpenBase(*rank1, "ranks/llama", nullptr);
  ASSERT_TRUE(opened.ok()) << opened.status();
  for (const auto& rank : {rank0, rank1}) {  // both write it, in their user's segments
    absl::StatusOr<AcquireResult> w =
        service_->Acquire(*rank, made->chunks, TierKind::kHost, Access::kWrite);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(pool_->OwnerOf(w->locations[0].segment), kAlice);
    ASSERT_TRUE(service_->Release(*rank, made->chunks).ok());
  }
  // Another job of the same user and the same job's name under another user: not theirs.
  EXPECT_TRUE(
      absl::IsPermissionDenied(service_->OpenBase(*other_job, "ranks/llama", nullptr).status()));
  EXPECT_TRUE(
      absl::IsPermissionDenied(service_->OpenBase(*other_user, "ranks/llama", nullptr).status()));
  // An operator reads it, and does not write it.
  std::shared_ptr<Session> root = *sessions_.Open({0, 0, 15}, "root");
  ASSERT_TRUE(service_->OpenBase(*root, "ranks/llama", nullptr).ok());
  EXPECT_TRUE(absl::IsPermissionDenied(
      service_->Acquire(*root, made->chunks, TierKind::kHost, Access::kWrite).status()));
  // It goes with the job's last session.
  service_->CloseSession(*root);
  service_->CloseSession(*rank0);
  EXPECT_EQ(service_->chunk_count(), 2u);
  service_->CloseSession(*rank1);
  EXPECT_EQ(service_->chunk_count(), 0u);
}

TEST_F(ChunkServiceBasesTest, ABaseOthersReadNeedsASegmentOfItsOwnAJobsBaseDoesNot) {
  // Every segment holds some of alice's chunks: none is free for a base's own.
  std::vector<ChunkRequest> r(4, ChunkRequest{.size = kSeg - 4096});
  ASSERT_TRUE(service_->Allocate(*alice_, r).ok());
  BaseRequest read_only = Request({4096});
  absl::Status s = service_->OpenBase(*alice_, "ro", &read_only).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  std::shared_ptr<Session> rank0 = *sessions_.Open({kAlice, kAlice, 11}, "rank0", "run-7");
  BaseRequest job = Request({4096, 4096});
  job.job_writable = true;
  absl::StatusOr<OpenedBase> made = service_->OpenBase(*rank0, "ranks/x", &job);
  EXPECT_TRUE(made.ok()) << made.status();
}

TEST_F(ChunkServiceBasesTest, ABaseItsJobWritesNeedsAJob) {
  BaseRequest r = Request({4096});
  r.job_writable = true;
  EXPECT_TRUE(absl::IsInvalidArgument(service_->OpenBase(*alice_, "ranks/x", &r).status()));
  EXPECT_EQ(service_->chunk_count(), 0u);
}

TEST(SessionRegistryBasesTest, UidsInTheBasesRangeAreRefused) {
  SessionRegistry sessions;
  EXPECT_TRUE(absl::IsPermissionDenied(sessions.Open({kFirstBaseOwner, 0, 1}, "x").status()));
}

}  // namespace
}  // namespace tierd::daemon
