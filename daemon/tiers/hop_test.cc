// CopyAlong: a chunk streamed over two hops. The hops here copy memory on threads of their own, as
// the real ones call back from theirs, and can be told to fail one piece; the NVMe and GPU hops
// themselves run under the chunk service's tests (nvme_service_test, device_service_test).
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/tiers/hop.h"
#include "gtest/gtest.h"

namespace tierd::daemon {
namespace {

// Copies between the job's addresses on a new thread per piece. `block`: pieces are whole blocks,
// the last one running past the job's size as an NVMe read's does. `fail_at`: the piece starting
// there fails instead.
class ThreadHop final : public Hop {
 public:
  ThreadHop(uint64_t block, uint64_t checksum) : block_(block), checksum_(checksum) {}
  ~ThreadHop() override {
    absl::MutexLock lock(&mu_);
    for (std::thread& t : threads_) t.join();
  }
  void FailAt(uint64_t offset) { fail_at_ = offset; }

  void Copy(const HopJob& job, Done done) override {
    Spawn([this, job, done = std::move(done)] {
      const bool fail = job.from.offset == fail_at_;
      if (!fail) std::memcpy(job.to_address, job.from_address, job.size);
      done(fail ? absl::DataLossError("piece failed") : absl::OkStatus(), checksum_);
    });
  }

  void CopyInPieces(const HopJob& job, uint64_t piece, OnPiece on_piece, Done done) override {
    Spawn([this, job, piece, on_piece = std::move(on_piece), done = std::move(done)] {
      const uint64_t length = (job.size + block_ - 1) / block_ * block_;
      absl::Status status;
      for (uint64_t off = 0; off < length; off += piece) {
        const uint64_t n = std::min(piece, length - off);
        if (job.from.offset + off == fail_at_) {
          status = absl::DataLossError("piece failed");
          continue;
        }
        std::memcpy(static_cast<char*>(job.to_address) + off,
                    static_cast<const char*>(job.from_address) + off,
                    std::min(n, job.size - std::min(job.size, off)));
        on_piece(off, n);
      }
      done(status, checksum_);
    });
  }

 private:
  template <typename F>
  void Spawn(F f) {
    absl::MutexLock lock(&mu_);
    threads_.emplace_back(std::move(f));
  }

  const uint64_t block_;
  const uint64_t checksum_;
  uint64_t fail_at_ = ~0ull;
  absl::Mutex mu_;
  std::vector<std::thread> threads_;
};

class CopyAlongTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSize = (10 << 20) + 12345;  // a tail shorter than a block
  static constexpr uint64_t kPiece = 1 << 20;

  CopyAlongTest() : source_(kSize + 4096), staging_(kSize + 4096), target_(kSize, 0) {
    std::iota(source_.begin(), source_.end(), 7);
  }

  // Runs the route; returns how often `done` ran (it must be once) and what it said.
  int Run(ThreadHop& first, ThreadHop& second, absl::Status* status, uint64_t* checksum) {
    HopJob a{.chunk_id = 1,
             .from_address = source_.data(),
             .to_address = staging_.data(),
             .size = kSize};
    HopJob b{.chunk_id = 1,
             .from_address = staging_.data(),
             .to_address = target_.data(),
             .size = kSize};
    absl::Mutex mu;
    int calls = 0;
    absl::Notification called;
    CopyAlong(&first, a, &second, b, kPiece, [&](absl::Status s, uint64_t c) {
      absl::MutexLock lock(&mu);
      ++calls;
      *status = s;
      *checksum = c;
      called.Notify();
    });
    called.WaitForNotification();
    absl::SleepFor(absl::Milliseconds(50));  // a second call would come now
    absl::MutexLock lock(&mu);
    return calls;
  }

  std::vector<uint8_t> source_, staging_, target_;
};

TEST_F(CopyAlongTest, EveryPieceCrossesBothHopsAndTheRouteCallsBackOnce) {
  ThreadHop read(4096, 0xfeed);
  ThreadHop copy(1, 0);
  absl::Status status = absl::UnknownError("not called");
  uint64_t checksum = 0;
  EXPECT_EQ(Run(read, copy, &status, &checksum), 1);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(checksum, 0xfeedu);  // the first hop's
  EXPECT_TRUE(std::equal(target_.begin(), target_.end(), source_.begin()));
}

TEST_F(CopyAlongTest, APieceThatFailsOnTheSecondHopFailsTheRouteOnce) {
  ThreadHop read(4096, 0);
  ThreadHop copy(1, 0);
  copy.FailAt(3 * kPiece);
  absl::Status status;
  uint64_t checksum = 0;
  EXPECT_EQ(Run(read, copy, &status, &checksum), 1);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  // The pieces after it still crossed: the route ends when every piece has settled.
  EXPECT_TRUE(
      std::equal(target_.begin() + 4 * kPiece, target_.end(), source_.begin() + 4 * kPiece));
}

TEST_F(CopyAlongTest, AFirstHopThatFailsFailsTheRouteAndItsPieceGoesNoFurther) {
  ThreadHop read(4096, 0);
  ThreadHop copy(1, 0);
  read.FailAt(2 * kPiece);
  absl::Status status;
  uint64_t checksum = 0;
  EXPECT_EQ(Run(read, copy, &status, &checksum), 1);
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_TRUE(std::all_of(target_.begin() + 2 * kPiece, target_.begin() + 3 * kPiece,
                          [](uint8_t b) { return b == 0; }));
}

TEST(HopJobTest, ASliceMovesPlacementsAndAddressesTogether) {
  char from[64], to[64];
  HopJob job{.from = Placement{.offset = 100},
             .to = Placement{.offset = 200},
             .from_address = from,
             .to_address = to,
             .size = 64};
  HopJob piece = Slice(job, 16, 8);
  EXPECT_EQ(piece.from.offset, 116u);
  EXPECT_EQ(piece.to.offset, 216u);
  EXPECT_EQ(piece.from_address, from + 16);
  EXPECT_EQ(piece.to_address, to + 16);
  EXPECT_EQ(piece.size, 8u);
  HopJob on_nvme{.size = 64};  // no addresses: they stay null
  EXPECT_EQ(Slice(on_nvme, 16, 8).from_address, nullptr);
}

}  // namespace
}  // namespace tierd::daemon
