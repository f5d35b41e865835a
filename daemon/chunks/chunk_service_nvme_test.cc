// Chunks moving between the host tier and a real NVMe tier through the chunk service: evict,
// prefetch, acquire, overwrite, flush and drain, moves joined and waited for, sessions ending
// mid-move, the drive shared by weight and deadline, room made in a full host tier.
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

TEST_F(ChunkServiceNvmeTest, EvictWritesAndDropsTheHostCopyPrefetchReadsItBack) {
  const std::vector<uint64_t> sizes = {4096, 1 << 20, 3 << 20, 12345};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 1);
  const uint64_t host_used = host_->Usage().used_bytes;
  const uint64_t syncs = faults_->seen(IoKind::kSync);  // formatting the regions synced them
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
  EXPECT_GT(nvme_->Usage().used_bytes, 0u);
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[1].resident.contains(TierKind::kHost));
  EXPECT_TRUE(stat[1].resident.contains(TierKind::kNvme));

  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  EXPECT_EQ(host_->Usage().used_bytes, host_used);
  EXPECT_TRUE(Check(*session_, ids, 1, sizes));
  // Writes went through registered buffers, split into 128 KiB I/Os. Scratch chunks do not
  // outlive the daemon, so nothing was flushed for them.
  EXPECT_GE(faults_->seen(IoKind::kWrite), (4u << 20) / (128 << 10));
  EXPECT_EQ(faults_->seen(IoKind::kSync), syncs);
}

TEST_F(ChunkServiceNvmeTest, TrafficIsCountedToTheHoldingSessionAndItsJob) {
  auto trainer = *sessions_.Open({1000, 1000, 7}, "trainer", "run-42");
  auto other = *sessions_.Open({1000, 1000, 8}, "other", "run-43");
  MapPage(*trainer);
  MapPage(*other);
  auto mine = Alloc(*trainer, {1 << 20, 1 << 20});
  std::vector<ChunkRequest> p = {{.size = 1 << 20, .name = "run-42/m", .persistent = true}};
  auto kept = *service_->Allocate(*trainer, p);
  auto theirs = Alloc(*other, {1 << 20});
  Write(*trainer, mine, 1);
  Write(*trainer, kept, 2);
  Write(*other, theirs, 3);
  std::vector<ChunkId> all = mine;
  all.push_back(kept[0]);
  ASSERT_TRUE(Wait(*trainer, service_->Evict(*trainer, all, TierKind::kNvme)).ok());
  ASSERT_TRUE(Wait(*trainer, service_->Prefetch(*trainer, mine, TierKind::kHost, 0)).ok());
  ASSERT_TRUE(Wait(*other, service_->Evict(*other, theirs, TierKind::kNvme)).ok());

  const std::map<std::string, PathArray<uint64_t>> jobs = service_->JobTraffic();
  const Path down = Path::kHostToNvme, up = Path::kNvmeToHost;
  EXPECT_EQ(jobs.at("run-42")[down], 3u << 20);  // its persistent chunk too: it holds the lease
  EXPECT_EQ(jobs.at("run-42")[up], 2u << 20);
  EXPECT_EQ(jobs.at("run-43")[down], 1u << 20);
  EXPECT_EQ(jobs.at("run-43")[up], 0u);
  const std::map<SessionId, SessionHoldings> h = service_->Holdings();
  EXPECT_EQ(h.at(trainer->id).moved_bytes, 5u << 20);
  EXPECT_EQ(h.at(trainer->id).chunks, 3u);
  EXPECT_EQ(h.at(other->id).moved_bytes, 1u << 20);
  // A job is forgotten with its last session (the metrics series ends).
  service_->CloseSession(*other);
  EXPECT_FALSE(service_->JobTraffic().contains("run-43"));
  EXPECT_TRUE(service_->JobTraffic().contains("run-42"));
}

// A chunk the daemon moved below the host tier (room for another, a quota, a drain) cannot be
// evicted to the host: the caller cannot have seen that coming, so it is the chunk's state that is
// wrong, not the request, and nothing changes.
TEST_F(ChunkServiceNvmeTest, EvictToTheHostOfAChunkAlreadyBelowItIsAFailedPrecondition) {
  auto ids = Alloc(*session_, {1 << 20});
  Write(*session_, ids, 7);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  const absl::Status s = service_->Evict(*session_, ids, TierKind::kHost).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("Prefetch"), absl::string_view::npos) << s;
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_TRUE(Check(*session_, ids, 7, {1 << 20}));
}

TEST_F(ChunkServiceNvmeTest, EvictOfAPersistentChunkIsDurableBeforeItCompletes) {
  std::vector<ChunkRequest> r = {{.size = 1 << 20, .name = "job/durable", .persistent = true}};
  auto ids = *service_->Allocate(*session_, r);
  Write(*session_, ids, 4);
  const uint64_t syncs = faults_->seen(IoKind::kSync);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  // The data's flush, then the index record's.
  EXPECT_GE(faults_->seen(IoKind::kSync), syncs + 2);
}

TEST_F(ChunkServiceNvmeTest, AcquireBringsChunksInFromNvmeAndItsTokenSaysWhenTheyAreThere) {
  const std::vector<uint64_t> sizes = {1 << 20, 2 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 5);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(20));
  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*PollCompletion(*pages_.at(session_->id), a->ready), SlotState::kPending);
  ASSERT_TRUE(Wait(*session_, a->ready).ok());
  faults_->SetDelay(absl::ZeroDuration());
  // The locations handed out before the data arrived are where it arrived.
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[i]));
    for (size_t j = 0; j < sizes[i] / 8; j += 511) ASSERT_EQ(w[j], Word(5, ids[i], j));
  }
  SessionStats stats = service_->session_stats(*session_);
  EXPECT_EQ(stats.waited, 2u);
  EXPECT_GE(stats.stall[TierKind::kHost], absl::Milliseconds(20));
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
}

TEST_F(ChunkServiceNvmeTest, AcquireJoinsAPrefetchInFlightInsteadOfReadingTwice) {
  const std::vector<uint64_t> sizes = {4 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 6);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(5));
  const uint64_t reads = faults_->seen(IoKind::kRead);
  auto prefetch = service_->Prefetch(*session_, ids, TierKind::kHost, 0);
  ASSERT_TRUE(prefetch.ok());
  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  auto again = service_->Prefetch(*session_, ids, TierKind::kHost, 0);  // also joins
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(Wait(*session_, *prefetch).ok());
  EXPECT_TRUE(Wait(*session_, a->ready).ok());
  EXPECT_TRUE(Wait(*session_, *again).ok());
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_EQ(faults_->seen(IoKind::kRead) - reads, (4u << 20) / (128 << 10));  // one read
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  EXPECT_TRUE(Check(*session_, ids, 6, sizes));
}

// A write-back in flight (the host copy kept) and an Acquire for write: the write waits until the
// copy being written out is no longer read, then makes the host copy the only valid one.
TEST_F(ChunkServiceNvmeTest, AcquireForWriteWaitsForAWriteBackOfTheSameCopy) {
  const std::vector<uint64_t> sizes = {2 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 7);
  faults_->SetDelay(absl::Milliseconds(5));
  auto flush = service_->Prefetch(*session_, ids, TierKind::kNvme, 0);  // write back, keep host
  ASSERT_TRUE(flush.ok());
  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kWrite);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*PollCompletion(*pages_.at(session_->id), a->ready), SlotState::kPending);
  ASSERT_TRUE(Wait(*session_, *flush).ok());
  ASSERT_TRUE(Wait(*session_, a->ready).ok());
  faults_->SetDelay(absl::ZeroDuration());
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kNvme));  // about to be overwritten
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
}

// Two requests wait on an eviction that drops the copy they want: the first fetches it again, the
// second joins that fetch rather than starting another move of a moving chunk.
TEST_F(ChunkServiceNvmeTest, RequestsWaitingOnAnEvictionShareOneFetchBackAfterIt) {
  const std::vector<uint64_t> sizes = {2 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 8);
  faults_->SetDelay(absl::Milliseconds(5));
  auto evict = service_->Evict(*session_, ids, TierKind::kNvme);  // drops the host copy
  ASSERT_TRUE(evict.ok());
  auto first = service_->Prefetch(*session_, ids, TierKind::kHost, 0);
  auto second = service_->Prefetch(*session_, ids, TierKind::kHost, 0);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(Wait(*session_, *evict).ok());
  EXPECT_TRUE(Wait(*session_, *first).ok());
  EXPECT_TRUE(Wait(*session_, *second).ok());
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_TRUE(Check(*session_, ids, 8, sizes));
}

// An Evict of a chunk already on its way down (a write-back that keeps the host copy, as the
// planner's are) waits for that move, then drops the host copy; one of a chunk being fetched waits
// for the fetch and writes nothing (the NVMe copy is current).
TEST_F(ChunkServiceNvmeTest, EvictOfAChunkThatIsMovingWaitsForTheMoveThenEvicts) {
  const std::vector<uint64_t> sizes = {2 << 20, 2 << 20};
  auto ids = Alloc(*session_, sizes);
  Write(*session_, ids, 9);
  faults_->SetDelay(absl::Milliseconds(5));
  const std::vector<ChunkId> first = {ids[0]}, second = {ids[1]};
  auto flush = service_->Prefetch(*session_, first, TierKind::kNvme, 0);  // keeps the host copy
  ASSERT_TRUE(flush.ok());
  ASSERT_TRUE(service_->Stat(*session_, first)->at(0).state == ChunkState::kMoving);
  auto evict = service_->Evict(*session_, first, TierKind::kNvme);
  ASSERT_TRUE(evict.ok()) << evict.status();
  EXPECT_TRUE(Wait(*session_, *flush).ok());
  EXPECT_TRUE(Wait(*session_, *evict).ok());
  auto stat = *service_->Stat(*session_, first);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kNvme));

  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, second, TierKind::kNvme)).ok());
  const uint64_t writes = faults_->seen(IoKind::kWrite);
  auto fetch = service_->Prefetch(*session_, second, TierKind::kHost, 0);
  ASSERT_TRUE(fetch.ok());
  auto again = service_->Evict(*session_, second, TierKind::kNvme);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(Wait(*session_, *fetch).ok());
  EXPECT_TRUE(Wait(*session_, *again).ok());
  EXPECT_EQ(faults_->seen(IoKind::kWrite), writes);
  EXPECT_FALSE(service_->Stat(*session_, second)->at(0).resident.contains(TierKind::kHost));
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_TRUE(Check(*session_, ids, 9, sizes));
}

// A chunk the daemon is writing down (to make room, or by a planner's choice) is one its owner
// cannot see moving: freeing it succeeds, and it ends, its space with it, when the move settles.
TEST_F(ChunkServiceNvmeTest, FreeOfAChunkBeingWrittenDownEndsItWhenTheMoveSettles) {
  const std::vector<uint64_t> sizes = {2 << 20};
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  Write(*session_, ids, 3);
  faults_->SetDelay(absl::Milliseconds(20));
  auto evict = service_->Evict(*session_, ids, TierKind::kNvme);
  ASSERT_TRUE(evict.ok()) << evict.status();
  ASSERT_EQ(service_->Stat(*session_, ids)->at(0).state, ChunkState::kMoving);
  EXPECT_TRUE(service_->Free(*session_, ids).ok());
  EXPECT_TRUE(Wait(*session_, *evict).ok());  // the write itself finishes
  faults_->SetDelay(absl::ZeroDuration());
  nvme_->Drain();
  EXPECT_TRUE(absl::IsNotFound(service_->Stat(*session_, ids).status()));
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
  EXPECT_EQ(nvme_->Usage().used_bytes, 0u);
  // A pinned chunk is still refused, moving or not.
  auto kept = Alloc(*session_, sizes);
  ASSERT_TRUE(service_->Acquire(*session_, kept, TierKind::kHost, Access::kRead).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Free(*session_, kept)));
  ASSERT_TRUE(service_->Release(*session_, kept).ok());
  EXPECT_TRUE(service_->Free(*session_, kept).ok());
}

TEST_F(ChunkServiceNvmeTest, AcquireWithNoRoomComingFailsAtOnceAndPinsNothing) {
  // The host tier is full of pinned chunks: a chunk on NVMe has nowhere to land.
  auto away = Alloc(*session_, {1 << 20});
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto filler = Alloc(*session_, {kSeg, kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*session_, filler, TierKind::kHost, Access::kRead).ok());
  auto a = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead);
  EXPECT_TRUE(absl::IsResourceExhausted(a.status())) << a.status();
  EXPECT_NE(a.status().message().find(absl::StrCat("chunk ", away[0])), std::string::npos)
      << a.status();
  EXPECT_EQ(service_->Stat(*session_, away)->at(0).pins, 0u);
  EXPECT_TRUE(absl::IsFailedPrecondition(service_->Release(*session_, away)));
  EXPECT_TRUE(service_->Release(*session_, filler).ok());
  EXPECT_TRUE(service_->Free(*session_, filler).ok());
  auto retry = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead);  // now it fits
  ASSERT_TRUE(retry.ok());
  EXPECT_TRUE(Wait(*session_, retry->ready).ok());
  EXPECT_TRUE(service_->Release(*session_, away).ok());
}

// What fills the tier is pinned by another session, which lets go a moment later (in training,
// a kernel's time): the Acquire waits for that room instead of failing, and the wait is counted
// as the session's stall.
TEST_F(ChunkServiceNvmeTest, AcquireWaitsForRoomAnotherSessionHoldsAndGetsItOnRelease) {
  std::shared_ptr<Session> other = *sessions_.Open({1000, 1000, 2}, "other");
  MapPage(*other);
  auto away = Alloc(*session_, {1 << 20});
  Write(*session_, away, 3);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto filler = Alloc(*other, {kSeg, kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*other, filler, TierKind::kHost, Access::kRead).ok());
  std::thread releaser([&] {
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_TRUE(service_->Release(*other, filler).ok());
  });
  const absl::Time asked = absl::Now();
  auto a = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead);
  releaser.join();
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(150));
  ASSERT_TRUE(Wait(*session_, a->ready).ok());
  EXPECT_GT(service_->session_stats(*session_).stall[TierKind::kHost], absl::ZeroDuration());
  EXPECT_TRUE(service_->Release(*session_, away).ok());
  EXPECT_TRUE(Check(*session_, away, 3, {1 << 20}));  // what came back is what was written
  service_->CloseSession(*other);
}

// The wait is bounded by the caller's deadline (its RPC's): a tenth of the time before it,
// RESOURCE_EXHAUSTED naming the tier, nothing pinned, and the chunk acquirable once the room is
// there.
TEST_F(ChunkServiceNvmeTest, AcquireWaitingForAnotherSessionsPinsGivesUpAtItsDeadline) {
  std::shared_ptr<Session> other = *sessions_.Open({1000, 1000, 2}, "other");
  MapPage(*other);
  auto away = Alloc(*session_, {1 << 20});
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto filler = Alloc(*other, {kSeg, kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*other, filler, TierKind::kHost, Access::kRead).ok());
  const absl::Time asked = absl::Now();
  auto a = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead,
                             asked + absl::Milliseconds(150));
  EXPECT_TRUE(absl::IsResourceExhausted(a.status())) << a.status();
  EXPECT_GE(absl::Now() - asked, absl::Milliseconds(135));
  EXPECT_NE(a.status().message().find("host tier came free within"), std::string::npos)
      << a.status();
  EXPECT_EQ(service_->Stat(*session_, away)->at(0).pins, 0u);
  ASSERT_TRUE(service_->Release(*other, filler).ok());
  auto retry = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_TRUE(Wait(*session_, retry->ready).ok());
  EXPECT_TRUE(service_->Release(*session_, away).ok());
  service_->CloseSession(*other);
}

// What can never fit is refused at once, whatever others hold: here the tenant's quota, which
// its own pinned chunk fills.
TEST_F(ChunkServiceNvmeTest, AChunkThatCannotFitBesideTheSessionsOwnPinsIsRefusedAtOnce) {
  Quotas q;
  q.by_uid[1000][TierKind::kHost] = 1 << 20;
  service_->set_limits(Limits{}, q);
  std::shared_ptr<Session> other = *sessions_.Open({2000, 2000, 2}, "other");
  MapPage(*other);
  auto mine = Alloc(*session_, {1 << 20});
  ASSERT_TRUE(service_->Acquire(*session_, mine, TierKind::kHost, Access::kRead).ok());
  auto away = Alloc(*session_, {1 << 20}, TierKind::kNvme);
  auto filler = Alloc(*other, {kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*other, filler, TierKind::kHost, Access::kRead).ok());
  const absl::Time asked = absl::Now();
  auto a =
      service_->Acquire(*session_, away, TierKind::kHost, Access::kRead, asked + absl::Seconds(30));
  EXPECT_TRUE(absl::IsResourceExhausted(a.status())) << a.status();
  EXPECT_LT(absl::Now() - asked, absl::Seconds(5));
  EXPECT_EQ(service_->Stat(*session_, away)->at(0).pins, 0u);
  ASSERT_TRUE(service_->Release(*other, filler).ok());
  ASSERT_TRUE(service_->Release(*session_, mine).ok());
  service_->CloseSession(*other);
}

// An overwrite wants room, not the old contents: it is ready at once, nothing is read from NVMe,
// and what it writes is what comes back.
TEST_F(ChunkServiceNvmeTest, AnOverwriteReadsNothingAndItsWritesComeBack) {
  const std::vector<uint64_t> sizes = {1 << 20, 3 << 20};
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  Write(*session_, ids, 1);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  const auto read = [&] { return service_->path_status()[Path::kNvmeToHost].bytes; };
  const uint64_t before = read();

  auto a = service_->Acquire(*session_, ids, TierKind::kHost, Access::kOverwrite);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(Wait(*session_, a->ready).ok());
  EXPECT_EQ(read(), before) << "an overwrite fetched the old contents";
  for (size_t i = 0; i < ids.size(); ++i) {
    auto* w = static_cast<uint64_t*>(host_->Address(a->locations[i]));
    for (size_t j = 0; j < sizes[i] / 8; ++j) w[j] = Word(2, ids[i], j);
  }
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
  auto stat = service_->Stat(*session_, ids);
  ASSERT_TRUE(stat.ok());
  for (const auto& s : *stat) EXPECT_TRUE(s.dirty.contains(TierKind::kHost));

  // Down to NVMe and back: the overwritten contents, not the first ones.
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_TRUE(Check(*session_, ids, 2, sizes));
  EXPECT_GT(read(), before);
}

TEST_F(ChunkServiceNvmeTest, AnOverwriteNeedsRoomWhereItLandsAndFailsCleanlyWithoutIt) {
  auto away = Alloc(*session_, {1 << 20}, TierKind::kNvme);
  Write(*session_, away, 1);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto filler = Alloc(*session_, {kSeg, kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*session_, filler, TierKind::kHost, Access::kRead).ok());
  auto a = service_->Acquire(*session_, away, TierKind::kHost, Access::kOverwrite);
  EXPECT_TRUE(absl::IsResourceExhausted(a.status())) << a.status();
  EXPECT_EQ(service_->Stat(*session_, away)->at(0).pins, 0u);
  ASSERT_TRUE(service_->Release(*session_, filler).ok());
  // Nothing lost: the NVMe copy is still the chunk's contents.
  EXPECT_TRUE(Check(*session_, away, 1, {1 << 20}));
}

TEST_F(ChunkServiceNvmeTest, AFailedAcquireGivesBackTheRoomItReservedForTheRestOfTheBatch) {
  auto filler = Alloc(*session_, {kSeg, kSeg, kSeg});
  ASSERT_TRUE(service_->Acquire(*session_, filler, TierKind::kHost, Access::kRead).ok());
  auto batch = Alloc(*session_, {1 << 20, kSeg}, TierKind::kNvme);  // the small one fits
  const uint64_t used = host_->Usage().used_bytes;
  auto a = service_->Acquire(*session_, batch, TierKind::kHost, Access::kRead);
  EXPECT_TRUE(absl::IsResourceExhausted(a.status())) << a.status();
  EXPECT_EQ(host_->Usage().used_bytes, used);
  EXPECT_TRUE(service_->Release(*session_, filler).ok());
}

// An Acquire that finds the tier full of copies still on their way in waits for them to land,
// then makes room by dropping one, instead of failing.
TEST_F(ChunkServiceNvmeTest, AcquireWaitsForMovesInFlightToLandAndMakesRoomFromThem) {
  std::vector<uint64_t> sizes(4, kSeg);
  auto filler = Alloc(*session_, sizes, TierKind::kNvme);
  for (size_t i = 0; i < filler.size(); ++i) {
    std::vector<ChunkId> one = {filler[i]};
    ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, one, TierKind::kHost, 0)).ok());
    Write(*session_, one, 300 + i);
  }
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, filler, TierKind::kNvme)).ok());
  auto away = Alloc(*session_, {1 << 20}, TierKind::kNvme);
  Write(*session_, away, 9);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(20));
  auto fill = service_->Prefetch(*session_, filler, TierKind::kHost, 0);  // the whole tier
  ASSERT_TRUE(fill.ok());
  auto a = service_->Acquire(*session_, away, TierKind::kHost, Access::kRead);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(Wait(*session_, a->ready).ok());
  EXPECT_TRUE(Wait(*session_, *fill).ok());
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_GT(service_->session_stats(*session_).stall[TierKind::kHost], absl::ZeroDuration());
  const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[0]));
  EXPECT_EQ(w[0], Word(9, away[0], 0));
  EXPECT_TRUE(service_->Release(*session_, away).ok());
}

TEST_F(ChunkServiceNvmeTest, SessionEndingWhileItsAcquireWaitsLeavesNothingBehind) {
  auto other = *sessions_.Open({1000, 1000, 2}, "other");
  MapPage(*other);
  auto ids = Alloc(*other, {4 << 20});
  ASSERT_TRUE(Wait(*other, service_->Evict(*other, ids, TierKind::kNvme)).ok());
  faults_->SetDelay(absl::Milliseconds(5));
  ASSERT_TRUE(service_->Acquire(*other, ids, TierKind::kHost, Access::kWrite).ok());
  EXPECT_EQ(service_->CloseSession(*other), 1u);  // the chunk goes when its read settles
  faults_->SetDelay(absl::ZeroDuration());
  nvme_->Drain();
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
}

// A training job killed while it prefetches: its chunks are being evicted, a Prefetch waits for
// each eviction to bring the chunk back, and the session ends. Nothing may start for a chunk whose
// session has gone; the waiters fail, and each chunk is destroyed once its last move settles.
TEST_F(ChunkServiceNvmeTest, SessionEndingWhileItsChunksMoveAndArePrefetchedLeavesNothingBehind) {
  auto killed = *sessions_.Open({1000, 1000, 2}, "killed");
  MapPage(*killed);
  const std::vector<uint64_t> sizes(4, 1 << 20);
  auto ids = Alloc(*killed, sizes);
  Write(*killed, ids, 12);
  faults_->SetDelay(absl::Milliseconds(20));
  auto evicted = service_->Evict(*killed, ids, TierKind::kNvme);
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  auto prefetched = service_->Prefetch(*killed, ids, TierKind::kHost, 0);  // waits for the writes
  ASSERT_TRUE(prefetched.ok()) << prefetched.status();
  const uint64_t reads = faults_->seen(IoKind::kRead);
  sessions_.Close(killed->id);
  EXPECT_EQ(service_->CloseSession(*killed), ids.size());
  nvme_->Drain();
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_EQ(service_->chunk_count(), 0u);
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
  EXPECT_EQ(nvme_->Usage().used_bytes, 0u);
  EXPECT_EQ(faults_->seen(IoKind::kRead), reads);  // nothing was read back for nobody
  const absl::Status prefetch = Wait(*killed, *prefetched);
  EXPECT_TRUE(absl::IsAborted(prefetch)) << prefetch;
  // The daemon still serves everyone else.
  auto mine = Alloc(*session_, {1 << 20});
  Write(*session_, mine, 13);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, mine, TierKind::kNvme)).ok());
  EXPECT_TRUE(Check(*session_, mine, 13, {1 << 20}));
}

TEST_F(ChunkServiceNvmeTest, FlushKeepsTheHostCopyAndLaterEvictNeedsNoWrite) {
  auto ids = Alloc(*session_, {1 << 20});
  Write(*session_, ids, 2);
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kNvme, 0)).ok());
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kNvme));
  const uint64_t writes = faults_->seen(IoKind::kWrite);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  EXPECT_EQ(faults_->seen(IoKind::kWrite), writes);  // the NVMe copy was already current
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
}

TEST_F(ChunkServiceNvmeTest, NvmeHomeChunkReadsAsZerosUntilWritten) {
  auto ids = Alloc(*session_, {256 << 10}, TierKind::kNvme);
  EXPECT_EQ(host_->Usage().used_bytes, 0u);
  const uint64_t reads = faults_->seen(IoKind::kRead);  // the superblocks, read at start-up
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ids, TierKind::kHost, 0)).ok());
  EXPECT_EQ(faults_->seen(IoKind::kRead), reads);  // nothing to read: it was never written
  auto a = *service_->Acquire(*session_, ids, TierKind::kHost, Access::kRead);
  const auto* bytes = static_cast<const unsigned char*>(host_->Address(a.locations[0]));
  for (size_t i = 0; i < (256 << 10); i += 997) ASSERT_EQ(bytes[i], 0);
  ASSERT_TRUE(service_->Release(*session_, ids).ok());
}

// Every chunk is read and written through host memory: an NVMe-home chunk larger than a host
// segment was accepted but could never be read.
TEST_F(ChunkServiceNvmeTest, AnNvmeHomeChunkLargerThanAHostSegmentIsRefusedAtAllocate) {
  std::vector<ChunkRequest> r = {{.size = kSeg + 4096, .home = TierKind::kNvme}};
  auto ids = service_->Allocate(*session_, r);
  ASSERT_TRUE(absl::IsInvalidArgument(ids.status())) << ids.status();
  EXPECT_NE(ids.status().message().find("at most host.segment_size"), std::string::npos)
      << ids.status();
  EXPECT_EQ(nvme_->Usage().used_bytes, 0u);
  r[0].size = kSeg;
  ids = service_->Allocate(*session_, r);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_TRUE(Wait(*session_, service_->Prefetch(*session_, *ids, TierKind::kHost, 0)).ok());
}

// Two sessions read 8 MiB each from a slow drive at once. The one with weight 4 gets about four
// of every five reads issued, so when its prefetch is done the other's has landed little; with
// equal weights they go at the same pace.
TEST_F(ChunkServiceNvmeTest, SessionsShareTheDriveByTheirBandwidthWeights) {
  auto other = *sessions_.Open({1001, 1001, 2}, "other");
  MapPage(*other);
  const std::vector<uint64_t> sizes(8, 1 << 20);
  const std::vector<ChunkId> mine = Alloc(*session_, sizes);
  const std::vector<ChunkId> theirs = Alloc(*other, sizes);
  Write(*session_, mine, 1);
  Write(*other, theirs, 2);
  auto landed_when_mine_are_in = [&](uint32_t my_weight) {
    EXPECT_TRUE(Wait(*session_, service_->Evict(*session_, mine, TierKind::kNvme)).ok());
    EXPECT_TRUE(Wait(*other, service_->Evict(*other, theirs, TierKind::kNvme)).ok());
    EXPECT_TRUE(service_->SetBandwidthWeight(*session_, my_weight).ok());
    faults_->SetDelay(absl::Milliseconds(20));
    absl::StatusOr<SlotToken> a = service_->Prefetch(*session_, mine, TierKind::kHost, 0);
    absl::StatusOr<SlotToken> b = service_->Prefetch(*other, theirs, TierKind::kHost, 0);
    EXPECT_TRUE(Wait(*session_, a).ok());
    int landed = 0;
    const absl::StatusOr<std::vector<ChunkMeta>> stat = service_->Stat(*other, theirs);
    EXPECT_TRUE(stat.ok()) << stat.status();
    for (const ChunkMeta& c : *stat) {
      landed += c.resident.contains(TierKind::kHost) ? 1 : 0;
    }
    EXPECT_TRUE(Wait(*other, b).ok());
    faults_->SetDelay(absl::ZeroDuration());
    return landed;
  };
  const int weighted = landed_when_mine_are_in(4);
  const int equal = landed_when_mine_are_in(1);
  EXPECT_LE(weighted, 3);
  EXPECT_GE(equal, 4);
  EXPECT_TRUE(Check(*session_, mine, 1, sizes));
  EXPECT_TRUE(Check(*other, theirs, 2, sizes));
  EXPECT_TRUE(absl::IsInvalidArgument(service_->SetBandwidthWeight(*other, 0)));
}

TEST_F(ChunkServiceNvmeTest, ReadAheadWithANegativePriorityLetsALaterWriteBackGoFirst) {
  const std::vector<uint64_t> sizes(8, 1 << 20);
  const std::vector<ChunkId> ahead = Alloc(*session_, sizes);
  const std::vector<ChunkId> dirty = Alloc(*session_, {1 << 20});
  Write(*session_, ahead, 1);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ahead, TierKind::kNvme)).ok());
  // How many of the read-ahead chunks are on the host when a write-back asked for after them
  // completes.
  auto landed_before_the_write = [&](int priority) {
    Write(*session_, dirty, 2);
    faults_->SetDelay(absl::Milliseconds(20));
    absl::StatusOr<SlotToken> read =
        service_->Prefetch(*session_, ahead, TierKind::kHost, priority);
    EXPECT_TRUE(Wait(*session_, service_->Evict(*session_, dirty, TierKind::kNvme)).ok());
    int landed = 0;
    const absl::StatusOr<std::vector<ChunkMeta>> stat = service_->Stat(*session_, ahead);
    EXPECT_TRUE(stat.ok()) << stat.status();
    for (const ChunkMeta& c : *stat) landed += c.resident.contains(TierKind::kHost) ? 1 : 0;
    EXPECT_TRUE(Wait(*session_, read).ok());
    faults_->SetDelay(absl::ZeroDuration());
    EXPECT_TRUE(Wait(*session_, service_->Evict(*session_, ahead, TierKind::kNvme)).ok());
    return landed;
  };
  EXPECT_GE(landed_before_the_write(0), 6);  // same priority: served in the order asked
  // Only what was already in the drive's queue lands first: two chunks' sub-I/Os fill its 16
  // slots when the write arrives, and the write's 8 share the next round with one more chunk's.
  EXPECT_LE(landed_before_the_write(-500), 3);
  EXPECT_TRUE(Check(*session_, ahead, 1, sizes));
  EXPECT_TRUE(Check(*session_, dirty, 2, {1 << 20}));
}

TEST_F(ChunkServiceNvmeTest, AnOperatorDrainsEveryUnpinnedChunkOfEverySessionOutOfTheHostTier) {
  const uint32_t me = geteuid();
  auto op = *sessions_.Open({me, me, 3}, "tierctl");
  auto a = *sessions_.Open({me + 1, me + 1, 4}, "trainer-a");
  auto b = *sessions_.Open({me + 2, me + 2, 5}, "trainer-b");
  MapPage(*op);
  MapPage(*a);
  MapPage(*b);
  const std::vector<ChunkId> mine = Alloc(*a, {1 << 20, 1 << 20});
  const std::vector<ChunkId> held = Alloc(*b, {1 << 20});
  Write(*a, mine, 11);
  Write(*b, held, 12);
  ASSERT_TRUE(service_->Acquire(*b, held, TierKind::kHost, Access::kRead).ok());

  // Only an operator may, and only out of the tiers above NVMe.
  EXPECT_TRUE(absl::IsPermissionDenied(service_->Drain(*a, TierKind::kHost, {}).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(service_->ListAll(*a, 0, 0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(service_->Drain(*op, TierKind::kNvme, {}).status()));
  const ChunkId unknown = 1ull << 60;
  EXPECT_TRUE(absl::IsNotFound(service_->Drain(*op, TierKind::kHost, {&unknown, 1}).status()));

  absl::StatusOr<DrainResult> drained = service_->Drain(*op, TierKind::kHost, {});
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(drained->chunks, 2);
  EXPECT_EQ(drained->bytes, 2u << 20);
  EXPECT_EQ(drained->pinned, 1);
  ASSERT_TRUE(WaitCompletion(*pages_.at(op->id), drained->token, absl::Seconds(30)).ok());
  const absl::StatusOr<std::vector<ChunkMeta>> stat = service_->Stat(*a, mine);
  ASSERT_TRUE(stat.ok()) << stat.status();
  for (const ChunkMeta& c : *stat) {
    EXPECT_FALSE(c.resident.contains(TierKind::kHost));
    EXPECT_TRUE(c.resident.contains(TierKind::kNvme));
  }
  EXPECT_TRUE(service_->Stat(*b, held)->at(0).resident.contains(TierKind::kHost));
  EXPECT_TRUE(Check(*a, mine, 11, {1 << 20, 1 << 20}));  // nothing lost on the way

  // Every chunk, by id, in pages.
  std::vector<ChunkId> listed;
  for (ChunkId token = 0;;) {
    absl::StatusOr<ChunkPage> page = service_->ListAll(*op, token, 2);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const ChunkMeta& c : page->chunks) listed.push_back(c.id);
    if ((token = page->next_page_token) == 0) break;
  }
  std::vector<ChunkId> all = {mine[0], mine[1], held[0]};
  std::sort(all.begin(), all.end());
  EXPECT_EQ(listed, all);
  const std::map<SessionId, SessionHoldings> h = service_->Holdings();
  EXPECT_EQ(h.at(a->id).chunks, 2);
  EXPECT_EQ(h.at(a->id).bytes, 2u << 20);
  EXPECT_EQ(h.at(b->id).pinned, 1);
  EXPECT_TRUE(service_->Release(*b, held).ok());
}

TEST(PrefetchDeadlineTest, EachUnitOfPriorityIsAMillisecondSoonerAndExtremesDoNotOverflow) {
  const absl::Time now = absl::FromUnixSeconds(1'000'000);
  EXPECT_EQ(PrefetchDeadline(now, 0), now);
  EXPECT_EQ(PrefetchDeadline(now, 5), now - absl::Milliseconds(5));
  EXPECT_EQ(PrefetchDeadline(now, -20), now + absl::Milliseconds(20));
  EXPECT_LT(PrefetchDeadline(now, std::numeric_limits<int>::max()), now);
  EXPECT_GT(PrefetchDeadline(now, std::numeric_limits<int>::min()), now);
}

TEST_F(ChunkServiceNvmeTest, FullHostTierPrefetchDropsTheLeastRecentlyUsedCleanCopies) {
  // Eight 8 MiB chunks (64 MiB of data) through a 64 MiB host tier, many times over.
  std::vector<uint64_t> sizes(8, 8 << 20);
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<ChunkId> one = {ids[i]};
    ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, one, TierKind::kHost, 0)).ok());
    Write(*session_, one, 100 + i);
    ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, one, TierKind::kNvme, 0)).ok());
  }
  // All of it is clean now; a new 16 MiB chunk must push out old copies to fit.
  auto extra = Alloc(*session_, {16 << 20}, TierKind::kNvme);
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, extra, TierKind::kHost, 0)).ok());
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));  // least recently used went first
  EXPECT_TRUE(stat[7].resident.contains(TierKind::kHost));
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<ChunkId> one = {ids[i]};
    ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, one, TierKind::kHost, 0)).ok());
    EXPECT_TRUE(Check(*session_, one, 100 + i, {8 << 20})) << i;
  }
}

TEST_F(ChunkServiceNvmeTest, ACopyReadAheadIsKeptOverOlderCopiesNobodyWantsUntilItIsAcquired) {
  // A 64 MiB host tier full of clean 8 MiB copies, the oldest first.
  std::vector<uint64_t> sizes(8, 8 << 20);
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<ChunkId> one = {ids[i]};
    Write(*session_, one, 100 + i);
    ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, one, TierKind::kNvme, 0)).ok());
  }
  // The oldest is read ahead again (it is there already), to be taken within a second.
  std::vector<ChunkId> ahead = {ids[0]};
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, ahead, TierKind::kHost, -1000)).ok());
  EXPECT_NE(((*service_->Stat(*session_, ahead))[0]).wanted_ns, 0);

  // Room for another chunk, made outside any plan, takes the oldest copy nobody wants instead.
  auto extra = Alloc(*session_, {8 << 20}, TierKind::kNvme);
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, extra, TierKind::kHost, 0)).ok());
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_TRUE(stat[0].resident.contains(TierKind::kHost));
  EXPECT_FALSE(stat[1].resident.contains(TierKind::kHost));

  // Taken: what was asked for has come, and the copy is an ordinary one again.
  EXPECT_TRUE(Check(*session_, ahead, 100, {8 << 20}));
  EXPECT_EQ(((*service_->Stat(*session_, ahead))[0]).wanted_ns, 0);
}

// On-demand swapping: a working set larger than the host tier, written through it chunk by chunk.
// The host fills with copies that exist nowhere else; each further acquire writes the least
// recently used of them to NVMe and lands in its room.
TEST_F(ChunkServiceNvmeTest, AcquiresThroughAHostTierFullOfWrittenChunksWriteTheOldestBack) {
  std::vector<uint64_t> sizes(12, 8 << 20);  // 96 MiB through 64 MiB
  auto ids = Alloc(*session_, sizes, TierKind::kNvme);
  faults_->SetDelay(absl::Milliseconds(1));
  const uint64_t writes = faults_->seen(IoKind::kWrite);
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < ids.size(); ++i) {
      std::vector<ChunkId> one = {ids[i]};
      auto a = service_->Acquire(*session_, one, TierKind::kHost, Access::kWrite);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(Wait(*session_, a->ready).ok()) << "pass " << pass << " chunk " << i;
      auto* w = static_cast<uint64_t*>(host_->Address(a->locations[0]));
      for (size_t j = 0; j < sizes[i] / 8; ++j) w[j] = Word(200 + pass, ids[i], j);
      ASSERT_TRUE(service_->Release(*session_, one).ok());
    }
  }
  faults_->SetDelay(absl::ZeroDuration());
  EXPECT_GT(faults_->seen(IoKind::kWrite), writes);
  auto stat = *service_->Stat(*session_, ids);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));  // the oldest went first
  EXPECT_TRUE(stat[11].resident.contains(TierKind::kHost));
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<ChunkId> one = {ids[i]};
    EXPECT_TRUE(Check(*session_, one, 201, {8 << 20})) << i;
  }
  EXPECT_LE(host_->Usage().used_bytes, 4 * kSeg);
}

// Trace mode: the acquisitions of one iteration, grouped by the step the cursor announced, become
// the schedule once the cursor passes the iteration's end.
TEST_F(ChunkServiceNvmeTest, ATraceRecordsOneIterationsAcquisitionsByStepAndInstallsThem) {
  auto ids = Alloc(*session_, {1 << 20, 1 << 20, 1 << 20, 1 << 20});
  auto scratch = Alloc(*session_, {1 << 20});
  CompletionPage& page = *pages_.at(session_->id);
  auto step = [&](uint64_t k) { page.header.cursor.store(k + 1); };
  auto acquire = [&](std::vector<ChunkId> which, Access access) {
    auto a = service_->Acquire(*session_, which, TierKind::kHost, access);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(Wait(*session_, a->ready).ok());
    ASSERT_TRUE(service_->Release(*session_, which).ok());
  };
  step(1);  // mid-iteration: the trace starts at step 3, the next multiple of 3
  ScheduleRequest trace;
  trace.trace_steps = 3;
  ASSERT_TRUE(service_->SetSchedule(*session_, trace).ok());
  EXPECT_TRUE(service_->session_stats(*session_).tracing);
  acquire({ids[3]}, Access::kRead);  // step 1: before the traced iteration
  step(3);
  acquire({ids[0], ids[1]}, Access::kRead);
  acquire({ids[0]}, Access::kWrite);  // read, then written in the same step: a write
  step(4);
  acquire({scratch[0]}, Access::kRead);
  step(5);
  acquire({ids[2]}, Access::kWrite);
  ASSERT_TRUE(service_->Free(*session_, scratch).ok());  // gone before the trace ends
  EXPECT_EQ(service_->session_stats(*session_).schedule_steps, 0u);
  // Out of the host before the next iteration, so that what the planner brings back shows what
  // the trace recorded: the chunks of steps 3 to 5 (ids 0, 1, 2), not the one acquired only before
  // and after the traced iteration (ids 3).
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, ids, TierKind::kNvme)).ok());
  step(6);  // the next iteration: the trace becomes the schedule
  EXPECT_EQ(service_->RunPlanningRound(absl::Now()), 3u);
  service_->WaitForIdle();
  const auto stat = service_->Stat(*session_, ids);
  ASSERT_TRUE(stat.ok()) << stat.status();
  for (int i : {0, 1, 2}) EXPECT_TRUE((*stat)[i].resident.contains(TierKind::kHost)) << i;
  EXPECT_FALSE((*stat)[3].resident.contains(TierKind::kHost));
  const SessionStats stats = service_->session_stats(*session_);
  EXPECT_FALSE(stats.tracing);
  EXPECT_EQ(stats.schedule_steps, 3u);
  // Both at once is refused; clearing ends it all.
  ScheduleRequest both;
  both.trace_steps = 2;
  both.steps = {{ScheduledAccess{ids[0], TierKind::kHost, Access::kRead}}};
  EXPECT_TRUE(absl::IsInvalidArgument(service_->SetSchedule(*session_, both)));
  ASSERT_TRUE(service_->SetSchedule(*session_, {}).ok());
  EXPECT_EQ(service_->session_stats(*session_).schedule_steps, 0u);
}

TEST_F(ChunkServiceNvmeTest, ConcurrentRandomMovesFromSeveralSessionsMatchAModel) {
  constexpr int kSessions = 3;
  constexpr int kOps = 150;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  std::vector<std::shared_ptr<Session>> sessions;
  for (int s = 0; s < kSessions; ++s) {
    sessions.push_back(*sessions_.Open({1000u + s, 1000, 10 + s}, "random"));
    MapPage(*sessions.back());
  }
  for (int s = 0; s < kSessions; ++s) {
    threads.emplace_back([&, s] {
      const Session& session = *sessions[s];
      std::mt19937_64 rng(s);
      struct Model {
        ChunkId id;
        uint64_t size;
        uint64_t seed;
      };
      std::vector<Model> live;
      for (int op = 0; op < kOps; ++op) {
        const int choice = live.empty() ? 0 : static_cast<int>(rng() % 5);
        if (choice == 0 && live.size() < 6) {  // allocate and write
          uint64_t size = 4096 * (1 + rng() % 256);
          auto ids = service_->Allocate(session, std::vector<ChunkRequest>{{.size = size}});
          if (!ids.ok()) continue;  // the host tier can be full: fine
          uint64_t seed = rng();
          Write(session, *ids, seed);
          live.push_back({(*ids)[0], size, seed});
          continue;
        }
        if (live.empty()) continue;
        Model& m = live[rng() % live.size()];
        std::vector<ChunkId> one = {m.id};
        if (choice == 1) {
          absl::Status st = Wait(session, service_->Evict(session, one, TierKind::kNvme));
          if (!st.ok()) ++failures;
        } else if (choice == 2) {
          absl::Status st = Wait(session, service_->Prefetch(session, one, TierKind::kHost, 0));
          if (absl::IsResourceExhausted(st)) continue;
          if (!st.ok() || !Check(session, one, m.seed, {m.size})) ++failures;
        } else if (choice == 3) {  // overwrite
          if (!Wait(session, service_->Prefetch(session, one, TierKind::kHost, 0)).ok()) continue;
          m.seed = rng();
          Write(session, one, m.seed);
        } else {  // free
          if (!service_->Free(session, one).ok()) ++failures;
          m = live.back();
          live.pop_back();
        }
      }
      for (const Model& m : live) {
        std::vector<ChunkId> one = {m.id};
        if (!Wait(session, service_->Prefetch(session, one, TierKind::kHost, 0)).ok() ||
            !Check(session, one, m.seed, {m.size})) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

}  // namespace
}  // namespace tierd::daemon
