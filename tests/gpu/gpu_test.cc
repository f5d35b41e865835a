// Tests that need a real GPU: the daemon's device pool exported as fds and imported in this (a
// second) process, data that lives only on the GPU checked by kernels across all three tiers.
// Without a GPU every test skips, saying so.
#include <cuda_runtime_api.h>

#include <cstring>

#include "gtest/gtest.h"
#include "kernels/pattern.h"
#include "tests/daemon_process.h"
#include "tierd/client.hpp"

namespace tierd {
namespace {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no GPU on this machine: the CUDA device tier is tested by tests/gpu/run.sh "
                      "on a CUDA machine; the emulated backend is tested everywhere";
    }
    auto daemon = testing::DaemonProcess::Start(
        {.binary = testing::ExecutableDir() + "/../../daemon/tierd",
         .args = {"--device=cuda", "--device_capacity=1GiB", "--device_segment_size=256MiB",
                  "--host_capacity=512MiB", "--host_segment_size=256MiB"}});
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = std::move(*daemon);
    auto client = Client::Connect({.socket_dir = daemon_->socket_dir(), .client_name = "gpu"});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches_), sizeof(unsigned long long)),
              cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (mismatches_ != nullptr) cudaFree(mismatches_);
    client_.reset();
    if (daemon_) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->Log();
    }
  }

  uint64_t Mismatches(const void* p, uint64_t bytes, uint64_t seed) {
    cudaMemsetAsync(mismatches_, 0, sizeof(unsigned long long), stream_);
    EXPECT_EQ(kernels::CountMismatches(p, bytes, seed, mismatches_, stream_), cudaSuccess);
    unsigned long long n = ~0ull;
    cudaMemcpyAsync(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost, stream_);
    cudaStreamSynchronize(stream_);
    return n;
  }

  std::unique_ptr<testing::DaemonProcess> daemon_;
  std::unique_ptr<Client> client_;
  cudaStream_t stream_ = nullptr;
  unsigned long long* mismatches_ = nullptr;
};

TEST_F(GpuTest, DevicePoolIsImportedFromTheDaemonAndWritableByKernels) {
  auto info = client_->GetNodeInfo();
  ASSERT_TRUE(info.ok());
  ASSERT_FALSE(info->devices.empty());
  EXPECT_EQ(info->devices[0].find("emulated"), std::string::npos);
  auto set = client_->Allocate(std::vector<ChunkSpec>(4, ChunkSpec{.size = 8 << 20}));
  ASSERT_TRUE(set.ok());
  auto up = client_->Prefetch(set->ids(), Tier::kDevice);
  ASSERT_TRUE(up.ok() && up->Wait().ok());
  auto d = client_->Acquire(set->ids(), Tier::kDevice, AccessMode::kWrite);
  ASSERT_TRUE(d.ok()) << d.status();
  for (size_t i = 0; i < d->size(); ++i) {
    EXPECT_FALSE((*d)[i].host_accessible);
    ASSERT_EQ(kernels::FillPattern((*d)[i].data, 8 << 20, i, stream_), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  for (size_t i = 0; i < d->size(); ++i) EXPECT_EQ(Mismatches((*d)[i].data, 8 << 20, i), 0u);
}

TEST_F(GpuTest, DataWrittenOnTheGpuSurvivesHostAndNvmeAndComesBack) {
  constexpr uint64_t kSize = 32 << 20;
  auto set = client_->Allocate(std::vector<ChunkSpec>(2, ChunkSpec{.size = kSize}));
  ASSERT_TRUE(set.ok());
  auto up = client_->Prefetch(set->ids(), Tier::kDevice);
  ASSERT_TRUE(up.ok() && up->Wait().ok());
  {
    auto d = client_->Acquire(set->ids(), Tier::kDevice, AccessMode::kWrite);
    ASSERT_TRUE(d.ok());
    for (size_t i = 0; i < d->size(); ++i) {
      ASSERT_EQ(kernels::FillPattern((*d)[i].data, kSize, 100 + i, stream_), cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  // Down to the host: the CPU sees the GPU's bytes.
  auto host = client_->Evict(set->ids(), Tier::kHost);
  ASSERT_TRUE(host.ok() && host->Wait().ok());
  {
    auto h = client_->Acquire(set->ids(), Tier::kHost, AccessMode::kRead);
    ASSERT_TRUE(h.ok());
    const auto* b = static_cast<const unsigned char*>((*h)[1].data);
    for (uint64_t j = 0; j < kSize; j += 4099) ASSERT_EQ(b[j], kernels::PatternByte(101, j)) << j;
  }
  // Down to NVMe and back up to the GPU (pipelined through host memory).
  auto nvme = client_->Evict(set->ids(), Tier::kNvme);
  ASSERT_TRUE(nvme.ok() && nvme->Wait().ok());
  auto back = client_->Prefetch(set->ids(), Tier::kDevice);
  ASSERT_TRUE(back.ok() && back->Wait().ok());
  auto d = client_->Acquire(set->ids(), Tier::kDevice, AccessMode::kRead);
  ASSERT_TRUE(d.ok());
  for (size_t i = 0; i < d->size(); ++i) EXPECT_EQ(Mismatches((*d)[i].data, kSize, 100 + i), 0u);
}

}  // namespace
}  // namespace tierd
