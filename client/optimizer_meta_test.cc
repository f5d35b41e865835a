// The optimizer's meta chunk codec: what is written reads back the same, the format earlier
// releases wrote still reads, and bytes that are not a meta chunk are DATA_LOSS, never trusted.
#include "client/optimizer_meta.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::internal {
namespace {

MetaRecord Example() {
  return MetaRecord{
      .shard_params = 16384,
      .steps = 12,
      .in_step = kSpeculativeStep,
      .state_type = 1,
      .generation = 3,
      .groups = {{.name = "g0.0",
                  .params = 40000,
                  .initialized = true,
                  .tensors = {0, 30000, 10000},
                  .tensor_steps = {12, 9, 0},
                  .shard_versions = {1, 0, 1}},
                 {.name = "empty", .params = 0, .tensors = {0}, .tensor_steps = {4}}}};
}

void ExpectSame(const MetaRecord& a, const MetaRecord& b) {
  EXPECT_EQ(a.shard_params, b.shard_params);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.in_step, b.in_step);
  EXPECT_EQ(a.state_type, b.state_type);
  EXPECT_EQ(a.generation, b.generation);
  ASSERT_EQ(a.groups.size(), b.groups.size());
  for (size_t g = 0; g < a.groups.size(); ++g) {
    EXPECT_EQ(a.groups[g].name, b.groups[g].name);
    EXPECT_EQ(a.groups[g].params, b.groups[g].params);
    EXPECT_EQ(a.groups[g].initialized, b.groups[g].initialized);
    EXPECT_EQ(a.groups[g].tensors, b.groups[g].tensors);
    EXPECT_EQ(a.groups[g].tensor_steps, b.groups[g].tensor_steps);
    EXPECT_EQ(a.groups[g].shard_versions, b.groups[g].shard_versions);
  }
}

TEST(OptimizerMetaTest, WhatIsEncodedDecodesTheSame) {
  const MetaRecord r = Example();
  std::vector<char> bytes(4096, 'x');
  ASSERT_LE(EncodedMetaSize(r), bytes.size());
  EncodeMeta(r, bytes);
  auto back = DecodeMeta(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->tensors_known());
  ExpectSame(r, *back);
  // Exactly its size is enough.
  back = DecodeMeta(std::span<const char>(bytes).first(EncodedMetaSize(r)));
  ASSERT_TRUE(back.ok()) << back.status();
}

// Earlier releases wrote format 1: one version per group and no tensors (each tensor is then at
// the steps taken).
TEST(OptimizerMetaTest, FormatOneStillReads) {
  struct {
    uint64_t magic = 0x316d616472656974ull;
    uint32_t version = 1, groups = 1;
    uint64_t shard_params = 1024;
    int64_t steps = 7;
    uint32_t in_step = 0, state_type = 0;
    uint64_t params = 5000;
    uint32_t initialized = 1, group_version = 1;
    char name[64] = "layer0";
  } v1;
  std::vector<char> bytes(4096, 0);
  std::memcpy(bytes.data(), &v1, sizeof(v1));
  auto r = DecodeMeta(bytes);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->tensors_known());
  EXPECT_EQ(r->steps, 7);
  ASSERT_EQ(r->groups.size(), 1u);
  EXPECT_EQ(r->groups[0].name, "layer0");
  EXPECT_EQ(r->groups[0].params, 5000u);
  EXPECT_TRUE(r->groups[0].initialized);
  EXPECT_EQ(r->groups[0].shard_versions, std::vector<uint8_t>{1});
}

TEST(OptimizerMetaTest, BytesThatAreNotAMetaChunkAreDataLoss) {
  const MetaRecord r = Example();
  std::vector<char> good(EncodedMetaSize(r));
  EncodeMeta(r, good);
  // Every truncation, and every byte of the counts and records changed.
  for (size_t n = 0; n < good.size(); ++n) {
    auto d = DecodeMeta(std::span<const char>(good).first(n));
    EXPECT_TRUE(absl::IsDataLoss(d.status())) << "truncated to " << n;
  }
  std::mt19937 rng(3);
  size_t refused = 0;
  for (size_t at = 0; at < good.size(); ++at) {
    std::vector<char> bad = good;
    bad[at] = static_cast<char>(bad[at] ^ (1 << (rng() % 8)));
    auto d = DecodeMeta(bad);
    if (!d.ok()) {
      EXPECT_TRUE(absl::IsDataLoss(d.status())) << d.status();
      EXPECT_NE(d.status().message().find("not one this library wrote"), std::string::npos);
      ++refused;
    }
  }
  EXPECT_GT(refused, 0u);
  // Counts far beyond the bytes: refused before anything is sized by them.
  std::vector<char> huge = good;
  const uint64_t many = uint64_t{1} << 60;
  std::memcpy(huge.data() + 40, &many, sizeof(many));  // Counts::tensors, after the header
  EXPECT_TRUE(absl::IsDataLoss(DecodeMeta(huge).status()));
  // A newer format is not guessed at.
  std::vector<char> newer = good;
  const uint32_t three = 3;
  std::memcpy(newer.data() + 8, &three, sizeof(three));
  auto d = DecodeMeta(newer);
  ASSERT_TRUE(absl::IsDataLoss(d.status()));
  EXPECT_NE(d.status().message().find("format version 3"), std::string::npos) << d.status();
}

}  // namespace
}  // namespace tierd::internal
