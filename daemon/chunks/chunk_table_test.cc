// ChunkTable: ids, and the name, persistent and recency indexes kept in step with the table.
#include "daemon/chunks/chunk_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

TEST(ChunkTableTest, IdsAreNeverReusedAndNamesBelongToTheirUser) {
  ChunkTable table;
  ChunkMeta& a = table.Insert(1000, "model/w0", /*persistent=*/true);
  ChunkMeta& b = table.Insert(2000, "model/w0", /*persistent=*/false);  // another user's name
  EXPECT_EQ(a.id, 1u);
  EXPECT_EQ(b.id, 2u);
  EXPECT_EQ(table.FindByName(1000, "model/w0"), &a);
  EXPECT_EQ(table.FindByName(2000, "model/w0"), &b);
  EXPECT_EQ(table.FindByName(3000, "model/w0"), nullptr);
  table.Erase(a);
  EXPECT_EQ(table.FindByName(1000, "model/w0"), nullptr);
  EXPECT_FALSE(table.contains(1));
  ChunkMeta& again = table.Insert(1000, "model/w0", /*persistent=*/true);
  EXPECT_EQ(again.id, 3u);  // not 1
  EXPECT_EQ(table.FindByName(1000, "model/w0"), &again);
  EXPECT_EQ(table.size(), 2u);
}

TEST(ChunkTableTest, EachUsersPersistentChunksAreKeptAsTheyComeAndGo) {
  ChunkTable table;
  ChunkMeta& p1 = table.Insert(1000, "opt/m/0", /*persistent=*/true);
  ChunkMeta& p2 = table.Insert(1000, "opt/m/1", /*persistent=*/true);
  table.Insert(1000, "", /*persistent=*/false);  // scratch, unnamed: in neither index
  table.Insert(2000, "opt/m/0", /*persistent=*/true);
  EXPECT_EQ(table.PersistentOf(1000), (std::set<ChunkId>{p1.id, p2.id}));
  EXPECT_EQ(table.persistent().size(), 2u);
  table.Erase(p1);
  EXPECT_EQ(table.PersistentOf(1000), (std::set<ChunkId>{p2.id}));
  table.Erase(p2);
  EXPECT_TRUE(table.PersistentOf(1000).empty());
  EXPECT_EQ(table.persistent().size(), 1u);  // the user with none left is gone from it
  EXPECT_TRUE(table.PersistentOf(4242).empty());
}

// The ids of the chunks with a copy in `tier`, least recently used first.
std::vector<ChunkId> OldestIn(ChunkTable& table, TierKind tier) {
  std::vector<ChunkId> ids;
  table.VisitOldestIn(tier, [&](ChunkMeta& c) {
    ids.push_back(c.id);
    return true;
  });
  return ids;
}

ChunkMeta& WithCopies(ChunkTable& table, uint64_t last_use, std::initializer_list<TierKind> in) {
  ChunkMeta& c = table.Insert(1000, "", /*persistent=*/false);
  c.last_use = last_use;
  for (TierKind t : in) c.resident.insert(t);
  table.Reindex(c);
  return c;
}

TEST(ChunkTableTest, EachTiersCopiesAreVisitedLeastRecentlyUsedFirst) {
  ChunkTable table;
  const TierKind host = TierKind::kHost, nvme = TierKind::kNvme;
  ChunkMeta& a = WithCopies(table, 30, {host, nvme});
  ChunkMeta& b = WithCopies(table, 10, {host});
  ChunkMeta& c = WithCopies(table, 20, {nvme});  // only on NVMe: never visited for the host
  EXPECT_EQ(OldestIn(table, host), (std::vector<ChunkId>{b.id, a.id}));
  EXPECT_EQ(OldestIn(table, nvme), (std::vector<ChunkId>{c.id, a.id}));
  EXPECT_TRUE(OldestIn(table, TierKind::kDevice).empty());
  // A use moves it to the back; a copy that arrives joins its tier.
  b.last_use = 40;
  b.resident.insert(nvme);
  table.Reindex(b);
  EXPECT_EQ(OldestIn(table, host), (std::vector<ChunkId>{a.id, b.id}));
  EXPECT_EQ(OldestIn(table, nvme), (std::vector<ChunkId>{c.id, a.id, b.id}));
  EXPECT_TRUE(table.CheckRecency().ok()) << table.CheckRecency();
}

TEST(ChunkTableTest, AVisitStopsWhereItIsToldTo) {
  ChunkTable table;
  for (uint64_t use : {5, 1, 3}) WithCopies(table, use, {TierKind::kHost});
  ChunkMeta* oldest = nullptr;
  int visited = 0;
  table.VisitOldestIn(TierKind::kHost, [&](ChunkMeta& c) {
    ++visited;
    oldest = &c;
    return false;
  });
  EXPECT_EQ(visited, 1);
  EXPECT_EQ(oldest->last_use, 1u);
}

TEST(ChunkTableTest, ACopyThatIsGoneIsForgottenEvenWithoutReindex) {
  ChunkTable table;
  ChunkMeta& a = WithCopies(table, 1, {TierKind::kHost, TierKind::kNvme});
  ChunkMeta& b = WithCopies(table, 2, {TierKind::kHost});
  a.resident.erase(TierKind::kHost);  // dropped by a path that did not reindex
  EXPECT_EQ(OldestIn(table, TierKind::kHost), (std::vector<ChunkId>{b.id}));
  EXPECT_FALSE(a.indexed.contains(TierKind::kHost));
  EXPECT_TRUE(table.CheckRecency().ok()) << table.CheckRecency();
  table.Erase(a);
  table.Erase(b);
  EXPECT_TRUE(OldestIn(table, TierKind::kHost).empty());
  EXPECT_TRUE(OldestIn(table, TierKind::kNvme).empty());
}

TEST(ChunkTableTest, ACopyOrAUseNotReindexedIsReportedByTheCheck) {
  ChunkTable table;
  ChunkMeta& a = WithCopies(table, 1, {TierKind::kNvme});
  a.resident.insert(TierKind::kHost);  // arrived, not filed: eviction could not see it
  absl::Status missing = table.CheckRecency();
  EXPECT_TRUE(absl::IsInternal(missing)) << missing;
  EXPECT_NE(missing.message().find("host"), std::string::npos) << missing;
  table.Reindex(a);
  EXPECT_TRUE(table.CheckRecency().ok());
  a.last_use = 9;  // used, not refiled
  EXPECT_FALSE(table.CheckRecency().ok());
  table.Reindex(a);
  EXPECT_TRUE(table.CheckRecency().ok());
}

}  // namespace
}  // namespace tierd::daemon
