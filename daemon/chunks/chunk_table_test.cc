// ChunkTable: ids, and the name and persistent indexes kept in step with the table.
#include "daemon/chunks/chunk_table.h"

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

}  // namespace
}  // namespace tierd::daemon
