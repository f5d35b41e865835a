// The NVMe region format and the index log: formatting, refusal of foreign or mismatched regions,
// replay, torn records, compaction.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "daemon/io/io_backend.h"
#include "daemon/tiers/host/host_memory.h"
#include "daemon/tiers/nvme/nvme_index.h"
#include "daemon/tiers/nvme/nvme_region.h"
#include "daemon/tiers/nvme/nvme_tier.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

class NvmeFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/tierd-format-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    HostPoolOptions o{.capacity = 4 << 20,
                      .segment_size = 4 << 20,
                      .huge_pages = HugePagePolicy::kNever,
                      .lock_memory = false};
    host_ = std::move(*CreateHostPool(o));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  NvmeOptions Options(int regions, uint64_t unit = 1 << 20) {
    NvmeOptions o;
    for (int i = 0; i < regions; ++i) {
      o.regions.push_back({dir_ + "/r" + std::to_string(i), 80 << 20});
    }
    o.stripe_unit = unit;
    o.io_size = unit;
    o.index_size = 4 << 20;
    return o;
  }
  absl::StatusOr<std::unique_ptr<NvmeTier>> Open(const NvmeOptions& o, uint8_t instance = 1) {
    InstanceId id{};
    id[0] = instance;
    return NvmeTier::Open(o, id, host_.get());
  }

  std::string dir_;
  std::unique_ptr<SegmentPool> host_;
};

TEST_F(NvmeFormatTest, BlankRegionsAreFormattedAndReopen) {
  {
    auto tier = Open(Options(2));
    ASSERT_TRUE(tier.ok()) << tier.status();
    // Two regions of 80 MiB, less 1 MiB header and 4 MiB index each.
    EXPECT_EQ((*tier)->Usage().capacity_bytes, 2u * (75 << 20));
    EXPECT_EQ((*tier)->Regions().size(), 2u);
  }
  auto again = Open(Options(2));
  ASSERT_TRUE(again.ok()) << again.status();
  auto region = NvmeRegion::Open({dir_ + "/r1", 0});
  ASSERT_TRUE(region.ok());
  auto engine = AttachOwnEngine(**region);
  auto sb = (*region)->ReadSuperblock();
  ASSERT_TRUE(sb.ok() && sb->has_value());
  EXPECT_EQ((*sb)->region_index, 1u);
  EXPECT_EQ((*sb)->region_count, 2u);
  EXPECT_EQ((*sb)->stripe_unit, 1u << 20);
  EXPECT_EQ((*region)->block_size() % 512, 0u);
}

// A region whose directory is missing is most often a drive that is not mounted: creating the
// directory would put a region file the size of the drive on whatever file system holds the
// mount point.
TEST_F(NvmeFormatTest, ARegionsMissingDirectoryIsNotCreatedButNamed) {
  NvmeOptions o = Options(1);
  o.regions[0].path = dir_ + "/mnt/nvme0/tierd.region";
  auto tier = Open(o);
  ASSERT_FALSE(tier.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(tier.status())) << tier.status();
  EXPECT_NE(tier.status().message().find("directory '" + dir_ + "/mnt/nvme0' does not exist"),
            std::string::npos)
      << tier.status();
  EXPECT_NE(tier.status().message().find("mounted"), std::string::npos) << tier.status();
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/mnt"));
}

// On a first start there is no record of the region set: a region file that cannot be created
// is an error naming it, not a region "missing" from a set that was never formatted.
TEST_F(NvmeFormatTest, ARegionThatCannotBeCreatedOnAFirstStartIsAnErrorNotACrash) {
  NvmeOptions o = Options(1);
  o.regions[0].path = "/proc/self/tierd-test.region";  // the directory exists; no file can
  auto tier = NvmeTier::Open(o, InstanceId{}, host_.get(), dir_ + "/state");
  ASSERT_FALSE(tier.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(tier.status())) << tier.status();
  EXPECT_NE(
      tier.status().message().find("cannot create NVMe region '/proc/self/tierd-test.region'"),
      std::string::npos)
      << tier.status();
}

TEST_F(NvmeFormatTest, AnotherInstancesRegionsAreRefused) {
  ASSERT_TRUE(Open(Options(1), 1).ok());
  auto other = Open(Options(1), 2);
  ASSERT_FALSE(other.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(other.status()));
  EXPECT_NE(other.status().message().find("belongs to another tierd instance"), std::string::npos)
      << other.status();
  NvmeOptions take_over = Options(1);
  take_over.reformat = true;
  EXPECT_TRUE(Open(take_over, 2).ok());
}

TEST_F(NvmeFormatTest, ChangedStripeUnitOrRegionOrderIsRefused) {
  ASSERT_TRUE(Open(Options(2)).ok());
  auto unit = Open(Options(2, 2 << 20));
  EXPECT_NE(unit.status().message().find("stripe unit"), std::string::npos) << unit.status();
  NvmeOptions swapped = Options(2);
  std::swap(swapped.regions[0], swapped.regions[1]);
  auto order = Open(swapped);
  EXPECT_NE(order.status().message().find("original order"), std::string::npos) << order.status();
}

TEST_F(NvmeFormatTest, ABlankRegionBesideFormattedOnesIsRefused) {
  ASSERT_TRUE(Open(Options(1)).ok());
  auto grown = Open(Options(2));
  EXPECT_TRUE(absl::IsFailedPrecondition(grown.status()));
  EXPECT_NE(grown.status().message().find("cannot gain regions"), std::string::npos);
}

TEST_F(NvmeFormatTest, OlderFormatVersionIsRefused) {
  ASSERT_TRUE(Open(Options(1)).ok());
  auto region = *NvmeRegion::Open({dir_ + "/r0", 0});
  auto engine = AttachOwnEngine(*region);
  Superblock sb = **region->ReadSuperblock();
  sb.version = 0;
  ASSERT_TRUE(region->WriteSuperblock(sb).ok());
  auto old = Open(Options(1));
  EXPECT_NE(old.status().message().find("format version 0"), std::string::npos) << old.status();
}

TEST_F(NvmeFormatTest, DamagedSuperblockIsDataLoss) {
  ASSERT_TRUE(Open(Options(1)).ok());
  int fd = open((dir_ + "/r0").c_str(), O_RDWR);
  ASSERT_EQ(pwrite(fd, "X", 1, 20), 1);  // inside the instance id
  close(fd);
  auto damaged = Open(Options(1));
  EXPECT_TRUE(absl::IsDataLoss(damaged.status())) << damaged.status();
}

// Superblocks are read through the tier's I/O seam: a drive that fails the read stops the start
// with the cause and the region, and formats nothing.
TEST_F(NvmeFormatTest, ASuperblockThatCannotBeReadStopsTheStartWithTheCause) {
  ASSERT_TRUE(Open(Options(2)).ok());
  NvmeOptions o = Options(2);
  o.wrap_backend = [](std::unique_ptr<IoBackend> inner) {
    auto faulty = std::make_unique<FaultInjectingBackend>(std::move(inner));
    faulty->FailNextIn(IoKind::kRead, 1, 0, 4096, EIO);
    return faulty;
  };
  auto failed = Open(o);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("Input/output error"), std::string::npos)
      << failed.status();
  EXPECT_NE(failed.status().message().find(dir_ + "/r1"), std::string::npos) << failed.status();
  EXPECT_TRUE(Open(Options(2)).ok());  // nothing was written over
}

TEST_F(NvmeFormatTest, StripedChunksSpreadOverAllRegions) {
  auto tier = *Open(Options(4));
  auto p = tier->Reserve(0, 8 << 20);  // 8 units over 4 regions
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->offset % (1 << 20), 0u);
  for (const RegionStatus& r : tier->Regions()) EXPECT_EQ(r.used_bytes, 2u << 20) << r.path;
  tier->Unreserve(*p);
  for (const RegionStatus& r : tier->Regions()) EXPECT_EQ(r.used_bytes, 0u);
}

TEST_F(NvmeFormatTest, FullTierIsResourceExhaustedWithTheNumbers) {
  auto tier = *Open(Options(1));
  ASSERT_TRUE(tier->Reserve(0, 75 << 20).ok());
  absl::Status s = tier->Reserve(0, 4096).status();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("75 MiB of 75 MiB in use"), std::string::npos) << s;
}

class NvmeIndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/var/tmp/tierd-index-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    region_ = std::move(*NvmeRegion::Open({dir_ + "/r", 8 << 20}));
    engine_ = AttachOwnEngine(*region_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // 64 KiB of index: two halves of 32 KiB = 8 blocks of 4 KiB, or 64 of 512 B.
  absl::StatusOr<std::unique_ptr<NvmeIndex>> Open(bool fresh) {
    return NvmeIndex::Open(region_.get(), 1 << 20, 64 << 10, fresh);
  }
  static IndexEntry Entry(const std::string& name, uint64_t offset) {
    return IndexEntry{1000, name, 4096, offset, 4096, 0xABCD + offset};
  }

  std::string dir_;
  std::unique_ptr<NvmeRegion> region_;
  std::unique_ptr<IoEngine> engine_;  // after the region: goes first
};

TEST_F(NvmeIndexTest, PutsAndRemovesReplayAfterReopen) {
  {
    auto index = *Open(true);
    ASSERT_TRUE(index->Put(Entry("a", 0)).ok());
    ASSERT_TRUE(index->Put(Entry("b", 4096)).ok());
    ASSERT_TRUE(index->Put(Entry("a", 8192)).ok());  // replaced
    ASSERT_TRUE(index->Remove(1000, "b").ok());
  }
  auto index = *Open(false);
  ASSERT_EQ(index->entries().size(), 1u);
  const IndexEntry& a = index->entries().at(NvmeIndex::Key(1000, "a"));
  EXPECT_EQ(a.offset, 8192u);
  EXPECT_EQ(a.checksum, 0xABCDu + 8192);
  EXPECT_EQ(index->skipped_records(), 0u);
}

TEST_F(NvmeIndexTest, TornRecordIsSkippedNotTrusted) {
  {
    auto index = *Open(true);
    ASSERT_TRUE(index->Put(Entry("a", 0)).ok());
    ASSERT_TRUE(index->Put(Entry("b", 4096)).ok());
    ASSERT_TRUE(index->Put(Entry("c", 8192)).ok());
  }
  // Damage the second record (block 2 of half 0): a torn write.
  const uint64_t block = region_->block_size();
  int fd = open((dir_ + "/r").c_str(), O_RDWR);
  ASSERT_EQ(pwrite(fd, "garbage", 7, (1 << 20) + 2 * block + 40), 7);
  close(fd);
  auto index = *Open(false);
  EXPECT_EQ(index->skipped_records(), 1u);
  EXPECT_TRUE(index->entries().contains(NvmeIndex::Key(1000, "a")));
  EXPECT_FALSE(index->entries().contains(NvmeIndex::Key(1000, "b")));
  EXPECT_TRUE(index->entries().contains(NvmeIndex::Key(1000, "c")));
}

TEST_F(NvmeIndexTest, FullHalfIsCompactedIntoTheOtherAndSurvivesReopen) {
  uint64_t generation;
  {
    auto index = *Open(true);
    const size_t records = index->capacity_records();
    // Rewrite the same two names many times: live data stays small, the log keeps growing.
    for (size_t i = 0; i < 3 * records; ++i) {
      ASSERT_TRUE(index->Put(Entry(i % 2 ? "x" : "y", (i % 2) * 4096)).ok()) << i;
    }
    generation = index->generation();
    EXPECT_GT(generation, 1u);
  }
  auto index = *Open(false);
  EXPECT_EQ(index->generation(), generation);
  EXPECT_EQ(index->entries().size(), 2u);
}

TEST_F(NvmeIndexTest, MoreLiveEntriesThanAHalfHoldsIsResourceExhausted) {
  auto index = *Open(true);
  absl::Status s;
  for (size_t i = 0; i < 2 * index->capacity_records() && s.ok(); ++i) {
    s = index->Put(Entry("n" + std::to_string(i), i * 4096));
  }
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("nvme.index_size"), std::string::npos);
}

TEST_F(NvmeIndexTest, ALaterRecordOverAnEarlierOnesSpaceDropsTheStaleEntry) {
  {
    auto index = *Open(true);
    ASSERT_TRUE(index->Put(Entry("old", 0)).ok());
    ASSERT_TRUE(index->Put(Entry("new", 0)).ok());  // "old"'s space was freed and reused
  }
  auto index = *Open(false);
  EXPECT_EQ(index->entries().size(), 1u);
  EXPECT_TRUE(index->entries().contains(NvmeIndex::Key(1000, "new")));
}

// A chunk at home in memory may be recorded with no copy on NVMe (reserved 0): such a record names
// no space, so it neither drops nor is dropped by a record at offset 0, and its flags replay, after
// compaction too.
TEST_F(NvmeIndexTest, RecordsWithoutACopyKeepTheirFlagsAndTakeNoSpace) {
  IndexEntry in_memory{1000, "mem", 8192, 0, 0, 0, /*memory_home=*/true, /*in_memory=*/true};
  IndexEntry written_down = Entry("down", 0);
  written_down.memory_home = true;
  {
    auto index = *Open(true);
    ASSERT_TRUE(index->Put(Entry("at-zero", 0)).ok());
    ASSERT_TRUE(index->Put(in_memory).ok());
    in_memory.name = "mem2";
    ASSERT_TRUE(index->Put(in_memory).ok());
    ASSERT_TRUE(index->Remove(1000, "at-zero").ok());
    ASSERT_TRUE(index->Put(written_down).ok());
  }
  auto check = [](const NvmeIndex& index) {
    ASSERT_EQ(index.entries().size(), 3u);
    for (const char* name : {"mem", "mem2"}) {
      const IndexEntry& e = index.entries().at(NvmeIndex::Key(1000, name));
      EXPECT_TRUE(e.memory_home && e.in_memory) << name;
      EXPECT_EQ(e.reserved, 0u) << name;
    }
    const IndexEntry& down = index.entries().at(NvmeIndex::Key(1000, "down"));
    EXPECT_TRUE(down.memory_home);
    EXPECT_FALSE(down.in_memory);
    EXPECT_EQ(down.reserved, 4096u);
  };
  auto index = *Open(false);
  check(*index);
  // Rewritten until the half is compacted into the other.
  for (size_t i = 0; i < 2 * index->capacity_records(); ++i) {
    ASSERT_TRUE(index->Put(written_down).ok()) << i;
  }
  check(*index);
  index.reset();
  check(**Open(false));
}

// --nvme_reformat writes a fresh index over an old one. Its records (of the same generation, or
// in the other half under a higher one) came back on the next replay: chunks that no longer exist,
// naming space that new chunks reuse. (Found by fuzz/nvme_index_fuzz.)
TEST_F(NvmeIndexTest, AnIndexFormattedAgainForgetsEverythingTheOldOneHeld) {
  {
    auto index = *Open(true);
    ASSERT_TRUE(index->Put(Entry("same-generation", 0)).ok());
  }
  ASSERT_TRUE(Open(true).ok());
  EXPECT_TRUE((*Open(false))->entries().empty());
  {
    auto index = *Open(true);
    for (size_t i = 0; i < 3 * index->capacity_records(); ++i) {  // compacted into half 1
      ASSERT_TRUE(index->Put(Entry(i % 2 ? "x" : "y", (i % 2) * 4096)).ok()) << i;
    }
  }
  ASSERT_TRUE(Open(true).ok());
  EXPECT_TRUE((*Open(false))->entries().empty());
}

TEST_F(NvmeIndexTest, MissingHeaderIsDataLoss) {
  std::vector<char> zeros(64 << 10, 0);
  int fd = open((dir_ + "/r").c_str(), O_RDWR);
  ASSERT_EQ(pwrite(fd, zeros.data(), zeros.size(), 1 << 20), static_cast<ssize_t>(zeros.size()));
  close(fd);
  EXPECT_TRUE(absl::IsDataLoss(Open(false).status()));
}

}  // namespace
}  // namespace tierd::daemon
