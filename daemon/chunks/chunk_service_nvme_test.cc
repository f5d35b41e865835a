// Chunks moving between the host tier and a real NVMe tier (io_uring on O_DIRECT files), through
// the chunk service, with faults injected at the I/O engine's seam.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/chunks/chunk_service.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

constexpr uint64_t kSeg = 16 << 20;

class ChunkServiceNvmeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/tierd-nvme-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    HostPoolOptions o{.capacity = 4 * kSeg,
                      .segment_size = kSeg,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    host_ = std::move(*CreateHostPool(o));
    OpenTier();
    session_ = *sessions_.Open({1000, 1000, 1}, "test");
    MapPage(*session_);
  }
  void TearDown() override {
    // As the daemon does: moves in flight settle (their callbacks use the service) before the
    // service goes. A test may end as soon as its completion is marked, mid-callback.
    if (nvme_ != nullptr) nvme_->Drain();
    service_.reset();
    nvme_.reset();
    for (auto& [id, page] : pages_) munmap(page, kCompletionPageBytes);
    std::filesystem::remove_all(dir_);
  }

  void OpenTier() {
    NvmeOptions o;
    o.regions = {{dir_ + "/r0", 96 << 20}, {dir_ + "/r1", 96 << 20}};
    o.stripe_unit = 256 << 10;
    o.io_size = 128 << 10;
    o.queue_depth = 16;
    o.index_size = 1 << 20;
    o.wrap_backend = [this](std::unique_ptr<IoBackend> inner) {
      auto f = std::make_unique<FaultInjectingBackend>(std::move(inner));
      faults_ = f.get();
      return f;
    };
    InstanceId id{};
    id[0] = 7;
    auto tier = NvmeTier::Open(o, id, host_.get());
    ASSERT_TRUE(tier.ok()) << tier.status();
    nvme_ = std::move(*tier);
    service_ = std::make_unique<ChunkService>(NodeTiers(host_.get(), nvme_.get()));
  }

  void MapPage(const Session& s) {
    void* p = mmap(nullptr, kCompletionPageBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   s.completions->fd(), 0);
    ASSERT_NE(p, MAP_FAILED);
    pages_[s.id] = static_cast<CompletionPage*>(p);
  }
  absl::Status Wait(const Session& s, absl::StatusOr<SlotToken> token) {
    if (!token.ok()) return token.status();
    return WaitCompletion(*pages_.at(s.id), *token, absl::Seconds(30));
  }

  std::vector<ChunkId> Alloc(const Session& s, std::vector<uint64_t> sizes,
                             TierKind home = TierKind::kHost) {
    std::vector<ChunkRequest> r;
    for (uint64_t size : sizes) r.push_back({.size = size, .home = home});
    auto ids = service_->Allocate(s, r);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return *ids;
  }
  // Writes a pattern into the chunks' host copies (acquire for write, fill, release).
  void Write(const Session& s, const std::vector<ChunkId>& ids, uint64_t seed) {
    auto a = service_->Acquire(s, ids, TierKind::kHost, Access::kWrite);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(Wait(s, a->ready).ok());  // a chunk being brought in is overwritten on arrival
    for (size_t i = 0; i < ids.size(); ++i) {
      auto* w = static_cast<uint64_t*>(host_->Address(a->locations[i]));
      for (size_t j = 0; j < a->locations[i].size / 8; ++j) w[j] = Word(seed, ids[i], j);
    }
    ASSERT_TRUE(service_->Release(s, ids).ok());
  }
  // True if the host copies hold the pattern.
  bool Check(const Session& s, const std::vector<ChunkId>& ids, uint64_t seed,
             const std::vector<uint64_t>& sizes) {
    auto a = service_->Acquire(s, ids, TierKind::kHost, Access::kRead);
    if (!a.ok()) {
      ADD_FAILURE() << a.status();
      return false;
    }
    if (absl::Status ready = Wait(s, a->ready); !ready.ok()) {
      ADD_FAILURE() << ready;
      return false;
    }
    bool ok = true;
    for (size_t i = 0; i < ids.size() && ok; ++i) {
      const auto* w = static_cast<const uint64_t*>(host_->Address(a->locations[i]));
      for (size_t j = 0; j < sizes[i] / 8 && ok; ++j) ok = w[j] == Word(seed, ids[i], j);
    }
    EXPECT_TRUE(service_->Release(s, ids).ok());
    return ok;
  }
  // The daemon stops — cleanly (session_ ends, what lives in memory is written down) or by dying —
  // and starts again from what the drive and the index hold. Returns the chunks recovered.
  size_t Restart(bool clean) {
    if (clean) {
      service_->CloseSession(*session_);
      EXPECT_EQ(service_->WriteDownForStop(), 0u);
    }
    service_.reset();
    nvme_.reset();
    OpenTier();
    return service_->Recover(nvme_->RecoveredEntries());
  }
  static uint64_t Word(uint64_t seed, ChunkId id, size_t j) {
    return (seed * 0x9E3779B97F4A7C15ull) ^ (id << 32) ^ j;
  }

  std::string dir_;
  std::unique_ptr<SegmentPool> host_;
  std::unique_ptr<NvmeTier> nvme_;
  FaultInjectingBackend* faults_ = nullptr;
  std::unique_ptr<ChunkService> service_;
  SessionRegistry sessions_;
  std::shared_ptr<Session> session_;
  std::map<SessionId, CompletionPage*> pages_;
};

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

// --- What one user may hold: quotas per tier and limits on chunks and schedules. ---

TEST_F(ChunkServiceNvmeTest, AUsersQuotaLimitsWhatItsChunksHoldInATierAndNamesIt) {
  Quotas q;
  q.per_uid[TierKind::kHost] = 8 << 20;
  q.by_uid[2000] = {};  // a user with no quota at all
  service_->set_limits(Limits{}, q);
  Alloc(*session_, {4 << 20, 4 << 20});
  std::vector<ChunkRequest> more = {{.size = 4 << 20}};
  auto refused = service_->Allocate(*session_, more);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("quota of 8 MiB (quota.host)"), std::string::npos)
      << refused.status();
  // Another user's quota is its own.
  auto other = *sessions_.Open({2000, 2000, 2}, "other");
  MapPage(*other);
  Alloc(*other, {4 << 20, 4 << 20, 4 << 20});
  const TenantUsage mine = service_->tenant_usage(1000);
  EXPECT_EQ(mine.bytes[TierKind::kHost], 8u << 20);
  EXPECT_EQ(mine.chunks, 2u);
  EXPECT_EQ(mine.refusals[static_cast<int>(LimitKind::kHostQuota)], 1u);
  EXPECT_EQ(service_->tenant_usage(2000).bytes[TierKind::kHost], 12u << 20);
}

// At its quota, a user's fetch makes room from its own copies, never another user's.
TEST_F(ChunkServiceNvmeTest, AUserAtItsQuotaMakesRoomFromItsOwnCleanCopiesOnly) {
  Quotas q;
  q.by_uid[1000][TierKind::kHost] = 8 << 20;
  service_->set_limits(Limits{}, q);
  auto other = *sessions_.Open({2000, 2000, 2}, "other");
  MapPage(*other);
  auto theirs = Alloc(*other, {4 << 20});  // used least recently of all
  Write(*other, theirs, 1);
  ASSERT_TRUE(Wait(*other, service_->Evict(*other, theirs, TierKind::kNvme, true)).ok());
  auto away = Alloc(*session_, {4 << 20});
  Write(*session_, away, 2);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto mine = Alloc(*session_, {4 << 20, 4 << 20});
  Write(*session_, mine, 3);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, mine, TierKind::kNvme, true)).ok());
  ASSERT_TRUE(Wait(*session_, service_->Prefetch(*session_, away, TierKind::kHost, 0)).ok());
  EXPECT_TRUE(service_->Stat(*other, theirs)->at(0).resident.contains(TierKind::kHost));
  auto stat = *service_->Stat(*session_, mine);
  EXPECT_FALSE(stat[0].resident.contains(TierKind::kHost));  // its least recently used
  EXPECT_TRUE(stat[1].resident.contains(TierKind::kHost));
  EXPECT_TRUE(Check(*session_, away, 2, {4 << 20}));
}

TEST_F(ChunkServiceNvmeTest, AUserAtItsQuotaWritesItsOwnDirtyCopiesDownToMakeRoom) {
  Quotas q;
  q.by_uid[1000][TierKind::kHost] = 8 << 20;
  service_->set_limits(Limits{}, q);
  auto away = Alloc(*session_, {4 << 20});
  Write(*session_, away, 4);
  ASSERT_TRUE(Wait(*session_, service_->Evict(*session_, away, TierKind::kNvme)).ok());
  auto dirty = Alloc(*session_, {4 << 20, 4 << 20});  // the quota, written only on the host
  Write(*session_, dirty, 5);
  EXPECT_TRUE(Check(*session_, away, 4, {4 << 20}));  // an Acquire: one dirty copy goes down
  EXPECT_EQ(service_->tenant_usage(1000).bytes[TierKind::kHost], 8u << 20);
  EXPECT_TRUE(Check(*session_, dirty, 5, {4 << 20, 4 << 20}));
}

TEST_F(ChunkServiceNvmeTest, ChunksPerSessionAndPerUserAreLimitedByName) {
  Limits l;
  l.chunks_per_session = 3;
  l.chunks_per_uid = 5;
  service_->set_limits(l, Quotas{});
  Alloc(*session_, {4096, 4096, 4096});
  std::vector<ChunkRequest> one = {{.size = 4096}};
  auto refused = service_->Allocate(*session_, one);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("limits.chunks_per_session (3)"), std::string::npos)
      << refused.status();
  auto second = *sessions_.Open({1000, 1000, 2}, "same user");
  MapPage(*second);
  auto two = Alloc(*second, {4096, 4096});
  refused = service_->Allocate(*second, one);
  ASSERT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("limits.chunks_per_uid (5)"), std::string::npos)
      << refused.status();
  ASSERT_TRUE(service_->Free(*second, {two.data(), 1}).ok());
  EXPECT_TRUE(service_->Allocate(*second, one).ok());
  EXPECT_EQ(service_->CloseSession(*second), 2u);
  EXPECT_EQ(service_->tenant_usage(1000).chunks, 3u);
}

TEST_F(ChunkServiceNvmeTest, SchedulesAndTracesAreLimitedPerSessionAndPerUser) {
  Limits l;
  l.schedule_accesses_per_session = 4;
  l.schedule_accesses_per_uid = 6;
  l.trace_steps = 8;
  service_->set_limits(l, Quotas{});
  auto ids = Alloc(*session_, {4096, 4096, 4096, 4096, 4096});
  auto schedule = [&](size_t accesses) {
    ScheduleRequest r;
    for (size_t i = 0; i < accesses; ++i) r.steps.push_back({{ids[i], TierKind::kHost}});
    return r;
  };
  absl::Status s = service_->SetSchedule(*session_, schedule(5));
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.schedule_accesses_per_session (4)"), std::string::npos) << s;
  ASSERT_TRUE(service_->SetSchedule(*session_, schedule(4)).ok());
  ASSERT_TRUE(service_->SetSchedule(*session_, schedule(3)).ok());  // replaces: 3 held, not 7
  ScheduleRequest empty_steps;  // many steps, few accesses: the steps count
  empty_steps.steps.resize(5);
  empty_steps.steps[0] = {{ids[0], TierKind::kHost}};
  EXPECT_TRUE(absl::IsResourceExhausted(service_->SetSchedule(*session_, empty_steps)));
  auto second = *sessions_.Open({1000, 1000, 2}, "same user");
  std::vector<ChunkRequest> four(4, ChunkRequest{.size = 4096});
  auto theirs = *service_->Allocate(*second, four);
  ScheduleRequest r;
  for (ChunkId id : theirs) r.steps.push_back({{id, TierKind::kHost}});
  s = service_->SetSchedule(*second, r);
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.schedule_accesses_per_uid (6)"), std::string::npos) << s;
  ScheduleRequest trace;
  trace.trace_steps = 9;
  s = service_->SetSchedule(*second, trace);
  ASSERT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("limits.trace_steps (8)"), std::string::npos) << s;
  service_->CloseSession(*session_);  // its schedule no longer counts
  EXPECT_TRUE(service_->SetSchedule(*second, r).ok());
  EXPECT_EQ(service_->tenant_usage(1000).schedule_accesses, 4u);
}

// Persistent chunks belong to their user, not a session: they count against its quota after its
// sessions have ended.
TEST_F(ChunkServiceNvmeTest, PersistentChunksCountAgainstTheirUsersQuotaAfterItsSessionsEnd) {
  Quotas q;
  q.per_uid[TierKind::kNvme] = 16 << 20;
  service_->set_limits(Limits{}, q);
  auto first = *sessions_.Open({1000, 1000, 2}, "first");
  MapPage(*first);
  std::vector<ChunkRequest> r = {{.size = 12 << 20, .name = "job/big", .persistent = true}};
  auto big = *service_->Allocate(*first, r);
  Write(*first, big, 6);
  ASSERT_TRUE(Wait(*first, service_->Evict(*first, big, TierKind::kNvme)).ok());
  service_->CloseSession(*first);
  EXPECT_EQ(service_->tenant_usage(1000).bytes[TierKind::kNvme], 12u << 20);
  r = {{.size = 8 << 20, .name = "job/more", .persistent = true}};
  auto more = *service_->Allocate(*session_, r);
  Write(*session_, more, 7);
  const absl::Status s = Wait(*session_, service_->Evict(*session_, more, TierKind::kNvme));
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("quota.nvme"), std::string::npos) << s;
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
