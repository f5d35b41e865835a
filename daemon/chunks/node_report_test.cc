// NodeReport on its own: listings a page at a time and what each session holds, over a table and
// ledgers the test fills.
#include "daemon/chunks/node_report.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "daemon/tiers/host/host_memory.h"
#include "daemon/util/clock.h"

namespace tierd::daemon {
namespace {

constexpr uint32_t kAlice = 1000, kBob = 2000;

class NodeReportTest : public testing::Test {
 protected:
  NodeReportTest()
      : host_(std::move(*CreateHostPool({.capacity = 4 << 20,
                                         .segment_size = 4 << 20,
                                         .huge_pages = HugePagePolicy::kNever,
                                         .lock_memory = false}))),
        tiers_(NodeTiers(host_.get())),
        space_(chunks_, ledger_, tiers_, clock_),
        bases_(chunks_, sessions_, space_, ledger_),
        report_(chunks_, sessions_, bases_, meter_) {
    alice_ = *registry_.Open({kAlice, kAlice, 1}, "alice");
    bob_ = *registry_.Open({kBob, kBob, 2}, "bob");
  }

  // A chunk of `size` bytes resident in the host tier (no space reserved: the report reads only).
  ChunkMeta& Chunk(uint32_t tenant, uint64_t size, bool persistent = false) {
    ChunkMeta& chunk =
        chunks_.Insert(tenant, persistent ? "p" + std::to_string(++named_) : "", persistent);
    chunk.size = size;
    chunk.home = TierKind::kHost;
    chunk.resident.insert(TierKind::kHost);
    chunks_.Reindex(chunk);
    return chunk;
  }

  ChunkMeta& Scratch(const Session& session, uint64_t size) {
    ChunkMeta& chunk = Chunk(session.peer.uid, size);
    chunk.owner = session.id;
    sessions_.Of(session).owned.insert(chunk.id);
    return chunk;
  }

  std::unique_ptr<SegmentPool> host_;
  const Tiers tiers_;
  FakeClock clock_;
  ChunkTable chunks_;
  TenantLedger ledger_;
  SessionLedger sessions_;
  PathMeter meter_;
  Space space_;
  SharedBases bases_;
  NodeReport report_;
  SessionRegistry registry_;
  std::shared_ptr<Session> alice_, bob_;
  int named_ = 0;
};

TEST_F(NodeReportTest, ASessionsPagesHoldItsChunksAndItsUsersPersistentOnesInIdOrder) {
  const ChunkId a = Scratch(*alice_, 10).id;
  const ChunkId p = Chunk(kAlice, 20, /*persistent=*/true).id;
  Scratch(*bob_, 30);  // not alice's
  const ChunkId c = Scratch(*alice_, 40).id;

  ChunkPage first = report_.SessionChunks(*alice_, 0, 2);
  ASSERT_EQ(first.chunks.size(), 2u);
  EXPECT_EQ(first.chunks[0].id, a);
  EXPECT_EQ(first.chunks[1].id, p);
  EXPECT_EQ(first.next_page_token, c);
  ChunkPage second = report_.SessionChunks(*alice_, first.next_page_token, 2);
  ASSERT_EQ(second.chunks.size(), 1u);
  EXPECT_EQ(second.chunks[0].id, c);
  EXPECT_EQ(second.next_page_token, 0u);  // the last page
}

TEST_F(NodeReportTest, TheNodesPagesHoldEveryChunkOnce) {
  std::vector<ChunkId> made;
  for (int i = 0; i < 5; ++i) made.push_back(Scratch(i % 2 ? *alice_ : *bob_, 1).id);
  std::vector<ChunkId> seen;
  ChunkId token = 0;
  do {
    ChunkPage page = report_.AllChunks(token, 2);
    EXPECT_LE(page.chunks.size(), 2u);
    for (const ChunkMeta& chunk : page.chunks) seen.push_back(chunk.id);
    token = page.next_page_token;
  } while (token != 0);
  EXPECT_EQ(seen, made);
}

TEST_F(NodeReportTest, HoldingsCountScratchChunksAndLeasedPersistentOnes) {
  Scratch(*alice_, 10);
  Scratch(*alice_, 20);
  const ChunkId leased = Chunk(kAlice, 100, /*persistent=*/true).id;
  sessions_.Grant(leased, alice_->id, /*shared=*/false);
  sessions_.Of(*bob_);

  const std::map<SessionId, SessionHoldings> holdings = report_.Holdings();
  ASSERT_EQ(holdings.size(), 2u);
  EXPECT_EQ(holdings.at(alice_->id).chunks, 3u);
  EXPECT_EQ(holdings.at(alice_->id).bytes, 130u);
  EXPECT_EQ(holdings.at(bob_->id).chunks, 0u);
}

TEST_F(NodeReportTest, TheNodesFiguresCountChunksByResidencyAndState) {
  Scratch(*alice_, 10);
  ChunkMeta& moving = Scratch(*bob_, 20);
  moving.state = ChunkState::kMoving;
  const NodeStats stats = report_.Stats();
  EXPECT_EQ(stats.chunks_ready, 1u);
  EXPECT_EQ(stats.chunks_moving, 1u);
  EXPECT_EQ(stats.resident_chunks[TierKind::kHost], 2u);
  EXPECT_EQ(stats.resident_bytes[TierKind::kHost], 30u);
  EXPECT_EQ(stats.shared_bases, 0u);
}

}  // namespace
}  // namespace tierd::daemon
