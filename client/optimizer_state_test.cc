// The optimizer's state record, the parts of it that need no daemon: a shard's layout (page-aligned
// regions, no p where the master is the group's out, bf16 moments half the bytes), the pieces of a
// group's tensors that fall in one shard, and the groups a caller may add (names, sizes, masters).
// optimizer_test.cc opens, resumes and steps the state against a real daemon.
#include "client/optimizer_state.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::internal {
namespace {

using Part = OffloadedAdam::Part;

TEST(ShardOfTest, EachRegionIsPageAlignedAndTheMomentsFollowTheWeights) {
  const Shard s = ShardOf(/*first=*/100, /*n=*/1000, ScalarType::kFloat32);
  EXPECT_EQ(s.first, 100u);
  EXPECT_EQ(s.n, 1000u);
  EXPECT_EQ(s.p_region, RoundUp(1000 * 4, kPage));
  EXPECT_EQ(s.mv_region, RoundUp(1000 * 4, kPage));
  EXPECT_EQ(s.offset(Part::kParams), 0u);
  EXPECT_EQ(s.offset(Part::kM), s.p_region);
  EXPECT_EQ(s.offset(Part::kV), s.p_region + s.mv_region);
  EXPECT_EQ(s.bytes(), s.p_region + 2 * s.mv_region);
  EXPECT_EQ(s.bytes() % kPage, 0u);
}

TEST(HostSlotsTest, ASegmentHoldsOnlyWholeShards) {
  constexpr uint64_t kMiB = 1 << 20;
  // Five 48 MiB shards fill 240 MiB of a 256 MiB segment: 2 GiB holds 40, not 42.
  EXPECT_EQ(HostSlots(2048 * kMiB, 256 * kMiB, 48 * kMiB), 40u);
  EXPECT_EQ(HostSlots(2048 * kMiB, 0, 48 * kMiB), 42u);  // segments not known: bytes
  // A budget's part segment holds what fits in it.
  EXPECT_EQ(HostSlots(600 * kMiB, 256 * kMiB, 48 * kMiB), 10u + 1u);
  // Shards that divide the segment lose nothing.
  EXPECT_EQ(HostSlots(2048 * kMiB, 256 * kMiB, 32 * kMiB), 64u);
}

TEST(ShardOfTest, BFloat16MomentsTakeHalfTheBytesAndAMasterInOutTakesNone) {
  const Shard fp32 = ShardOf(0, 4096, ScalarType::kFloat32);
  const Shard bf16 = ShardOf(0, 4096, ScalarType::kBFloat16);
  EXPECT_EQ(bf16.p_region, fp32.p_region);  // the master weights stay fp32
  EXPECT_EQ(2 * bf16.mv_region, fp32.mv_region);
  const Shard out = ShardOf(0, 4096, ScalarType::kFloat32, ParamGroup::Master::kOut);
  EXPECT_EQ(out.p_region, 0u);
  EXPECT_EQ(out.offset(Part::kM), 0u);
  EXPECT_EQ(StateBytesPerParam(ScalarType::kFloat32), 12u);
  EXPECT_EQ(StateBytesPerParam(ScalarType::kBFloat16), 8u);
}

// A group of tensors of the given sizes, laid end to end from 0.
Group GroupOf(std::vector<uint64_t> tensors) {
  Group g;
  g.spec.name = "g";
  g.spec.tensors = std::move(tensors);
  uint64_t first = 0;
  for (uint64_t n : g.spec.tensors) {
    g.tensor_first.push_back(first);
    first += n;
  }
  g.spec.params = first;
  return g;
}

TEST(PiecesOfTest, AShardHoldsTheFlaggedPartsOfTheTensorsThatCrossItFromItsFirst) {
  const Group g = GroupOf({3, 0, 5, 4});
  const std::vector<uint8_t> all = {1, 1, 1, 1};
  // Parameters [2, 9): the last of tensor 0, none of the empty tensor 1, all of tensor 2 and the
  // first of tensor 3.
  const Shard s = ShardOf(2, 7, ScalarType::kFloat32);
  const std::vector<Piece> pieces = PiecesOf(g, s, all);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].tensor, 0u);
  EXPECT_EQ(pieces[0].begin, 0u);
  EXPECT_EQ(pieces[0].end, 1u);
  EXPECT_EQ(pieces[1].tensor, 2u);
  EXPECT_EQ(pieces[1].begin, 1u);
  EXPECT_EQ(pieces[1].end, 6u);
  EXPECT_EQ(pieces[2].tensor, 3u);
  EXPECT_EQ(pieces[2].begin, 6u);
  EXPECT_EQ(pieces[2].end, 7u);
}

TEST(PiecesOfTest, TensorsWithoutFlagsAreLeftOutWithTheirFlagsKept) {
  const Group g = GroupOf({3, 0, 5, 4});
  const std::vector<uint8_t> flags = {0, 0, 2, 0};
  const std::vector<Piece> pieces = PiecesOf(g, ShardOf(0, 12, ScalarType::kFloat32), flags);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].tensor, 2u);
  EXPECT_EQ(pieces[0].begin, 3u);
  EXPECT_EQ(pieces[0].end, 8u);
  EXPECT_EQ(pieces[0].flags, 2);
  const std::vector<uint8_t> none = {0, 0, 0, 0};
  EXPECT_TRUE(PiecesOf(g, ShardOf(0, 12, ScalarType::kFloat32), none).empty());
}

ParamGroup Spec(std::string name, uint64_t params, std::vector<uint64_t> tensors = {}) {
  ParamGroup g;
  g.name = std::move(name);
  g.params = params;
  g.tensors = std::move(tensors);
  return g;
}

TEST(ValidateGroupsTest, AGroupWithoutTensorsIsOneTensorOfAllItsParameters) {
  std::vector<ParamGroup> specs = {Spec("decoder.0", 10), Spec("head", 6, {2, 0, 4})};
  ASSERT_TRUE(ValidateGroups(specs, {}, /*persistent=*/true).ok());
  EXPECT_EQ(specs[0].tensors, std::vector<uint64_t>{10});
  EXPECT_EQ(specs[1].tensors, (std::vector<uint64_t>{2, 0, 4}));
}

TEST(ValidateGroupsTest, BadGroupsAreRefusedNamingTheGroup) {
  auto refused = [](std::vector<ParamGroup> specs, const std::vector<Group>& existing = {},
                    bool persistent = true) {
    const absl::Status s = ValidateGroups(specs, existing, persistent);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_NE(refused({Spec("", 1)}).find("must be 1 to"), std::string::npos);
  EXPECT_NE(refused({Spec("a/b", 1)}).find("outside letters"), std::string::npos);
  EXPECT_NE(refused({Spec("meta", 1)}).find("reserved"), std::string::npos);
  EXPECT_NE(refused({Spec("g", 10, {3, 3})}).find("do not add up"), std::string::npos);
  EXPECT_NE(refused({Spec("g", 10, {8, 8})}).find("do not add up"), std::string::npos);
  EXPECT_NE(refused({Spec("g", 1), Spec("g", 2)}).find("appears twice"), std::string::npos);
  Group held = GroupOf({4});
  held.spec.name = "g";
  EXPECT_NE(refused({Spec("g", 1)}, {held}).find("appears twice"), std::string::npos);
  ParamGroup out = Spec("g", 4);
  out.master = ParamGroup::Master::kOut;
  EXPECT_NE(refused({out}).find("persistent state cannot restore"), std::string::npos);
  std::vector<ParamGroup> scratch = {out};
  EXPECT_TRUE(ValidateGroups(scratch, {}, /*persistent=*/false).ok());
  ParamGroup unknown = Spec("g", 4);
  unknown.master = static_cast<ParamGroup::Master>(7);
  EXPECT_NE(refused({unknown}).find("is not kState or kOut"), std::string::npos);
}

}  // namespace
}  // namespace tierd::internal
