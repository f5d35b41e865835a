// The read-ahead window against a real daemon: shards at home on NVMe come up ahead of their turn
// as far as the budget allows, go back down when not wanted, and never hold more than the budget.
#include "client/read_ahead.h"

#include <vector>

#include "gtest/gtest.h"
#include "testing/daemon_process.h"

namespace tierd::internal {
namespace {

using testing::DaemonProcess;

constexpr uint64_t kShard = 1 << 20;

class ReadAheadWindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto daemon =
        DaemonProcess::Start({.binary = testing::ExecutableDir() + "/../daemon/tierd",
                              .args = {"--host_capacity=32MiB", "--host_segment_size=16MiB",
                                       "--device=none", "--probe_bytes=0"}});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    ClientOptions o;
    o.socket_dir = daemon_->socket_dir();
    auto client = Client::Connect(o);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    // Eight shards at home on NVMe (never written: they read as zeros).
    std::vector<ChunkSpec> specs(8, ChunkSpec{.size = kShard, .home = Tier::kNvme});
    auto ids = client_->AllocateIds(specs);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ids_ = *ids;
  }
  void TearDown() override {
    client_.reset();
    if (daemon_) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
    }
  }

  bool OnHost(ChunkId id) {
    auto info = client_->Stat({&id, 1});
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return false;
    for (Tier t : (*info)[0].resident) {
      if (t == Tier::kHost) return true;
    }
    return false;
  }
  // Waits for every prefetch the window asked for (its tokens are its own: stat until there).
  void Settle() {
    for (int i = 0; i < 2000; ++i) {
      bool moving = false;
      auto info = client_->Stat(ids_);
      ASSERT_TRUE(info.ok());
      for (const ChunkInfo& c : *info) moving = moving || c.moving;
      if (!moving) return;
      absl::SleepFor(absl::Milliseconds(1));
    }
    FAIL() << "chunks still moving";
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  std::vector<ChunkId> ids_;
};

TEST_F(ReadAheadWindowTest, FillsTheBudgetInTheOrderExpectedAndNoFurther) {
  ReadAheadWindow window;
  window.Bind(client_.get(), /*streams=*/true);
  window.set_slots(4);
  size_t asked = 0;
  ASSERT_TRUE(window
                  .Fill(/*in_hand=*/1, absl::Milliseconds(1),
                        [&](size_t want) {
                          asked = want;
                          return ids_;  // more than there is room for
                        })
                  .ok());
  EXPECT_EQ(asked, 3u);  // four slots, one in hand
  for (size_t i = 0; i < ids_.size(); ++i) EXPECT_EQ(window.Holds(ids_[i]), i < 3) << i;
  Settle();
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(OnHost(ids_[i])) << i;
  EXPECT_FALSE(OnHost(ids_[3]));
  // Full: a second fill asks for nothing new.
  ASSERT_TRUE(window.Fill(1, absl::ZeroDuration(), [&](size_t) { return ids_; }).ok());
  EXPECT_FALSE(window.Holds(ids_[3]));
}

TEST_F(ReadAheadWindowTest, TakingAShardLeavesRoomAndDroppingSendsTheRestDown) {
  ReadAheadWindow window;
  window.Bind(client_.get(), true);
  window.set_slots(3);
  ASSERT_TRUE(window.Fill(0, absl::ZeroDuration(), [&](size_t) { return ids_; }).ok());
  Settle();
  EXPECT_TRUE(window.Take(ids_[0]));  // about to be pinned: out of the window
  EXPECT_FALSE(window.Take(ids_[0]));
  EXPECT_FALSE(window.Holds(ids_[0]));
  ASSERT_TRUE(window.Drop().ok());
  ASSERT_TRUE(window.WaitWrites(0).ok());
  EXPECT_FALSE(window.Holds(ids_[1]));
  EXPECT_FALSE(OnHost(ids_[1]));  // sent back down
  EXPECT_FALSE(OnHost(ids_[2]));
  EXPECT_TRUE(OnHost(ids_[0]));  // taken: the caller's now
}

TEST_F(ReadAheadWindowTest, MakingRoomGivesUpTheFurthestReadAheadFirst) {
  ReadAheadWindow window;
  window.Bind(client_.get(), true);
  window.set_slots(3);
  ASSERT_TRUE(window.Fill(0, absl::ZeroDuration(), [&](size_t) { return ids_; }).ok());
  Settle();
  ASSERT_TRUE(window.MakeRoom(/*in_hand=*/1).ok());  // three read ahead and one in hand: one goes
  EXPECT_TRUE(window.Holds(ids_[0]));
  EXPECT_TRUE(window.Holds(ids_[1]));
  EXPECT_FALSE(window.Holds(ids_[2]));
  EXPECT_FALSE(OnHost(ids_[2]));
}

TEST_F(ReadAheadWindowTest, StateAtHomeOnTheHostDoesNotStream) {
  ReadAheadWindow window;
  window.Bind(client_.get(), /*streams=*/false);
  window.set_slots(4);
  bool asked = false;
  ASSERT_TRUE(window
                  .Fill(0, absl::ZeroDuration(),
                        [&](size_t) {
                          asked = true;
                          return ids_;
                        })
                  .ok());
  EXPECT_FALSE(asked);
  EXPECT_FALSE(window.Holds(ids_[0]));
  ASSERT_TRUE(window.WriteBack(ids_[0]).ok());  // nothing to write back
  EXPECT_EQ(*window.MakeRoom(8), absl::ZeroDuration());
}

}  // namespace
}  // namespace tierd::internal
