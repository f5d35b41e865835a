// Tests that need a real GPU: the daemon's device pool exported as fds and imported in this (a
// second) process, data that lives only on the GPU checked by kernels across all three tiers.
// Without a GPU every test skips, saying so.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu_adam.h"
#include "kernels/gpu_adam.h"
#include "kernels/pattern.h"
#include "testing/daemon_process.h"
#include "tierd/client.hpp"
#include "tierd/optimizer.hpp"

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
                  "--host_capacity=512MiB", "--host_segment_size=256MiB"},
         // Room for every chunk a test moves down to NVMe (the stream-wait test evicts 256 MiB).
         .nvme_region_size = "1GiB",
         .start_timeout = absl::Seconds(120)});
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

TEST_F(GpuTest, CudaDeviceIsTheDaemonsGpuByUuid) {
  auto ordinal = client_->CudaDevice();
  ASSERT_TRUE(ordinal.ok()) << ordinal.status();
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, *ordinal), cudaSuccess);
  char uuid[64];
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  snprintf(uuid, sizeof(uuid),
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
           b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14],
           b[15]);
  EXPECT_EQ(client_->GetNodeInfo()->device_uuid, uuid);
}

TEST_F(GpuTest, HostChunksAreRegisteredWithCudaOnceTheGpuIsInUse) {
  auto set = client_->Allocate(std::vector<ChunkSpec>(1, ChunkSpec{.size = 4 << 20}));
  ASSERT_TRUE(set.ok());
  ASSERT_TRUE(client_->CudaDevice().ok());
  auto h = client_->Acquire(set->ids(), Tier::kHost, AccessMode::kWrite);
  ASSERT_TRUE(h.ok());
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, (*h)[0].data), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);  // page-locked: DMA, not a staged copy
  // A copy from it to the GPU runs as DMA and carries the bytes.
  std::memset((*h)[0].data, 0x5A, 4 << 20);
  void* dev = nullptr;
  ASSERT_EQ(cudaMalloc(&dev, 4 << 20), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(dev, (*h)[0].data, 4 << 20, cudaMemcpyHostToDevice, stream_),
            cudaSuccess);
  unsigned char back = 0;
  ASSERT_EQ(
      cudaMemcpyAsync(&back, static_cast<char*>(dev) + 12345, 1, cudaMemcpyDeviceToHost, stream_),
      cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(back, 0x5A);
  cudaFree(dev);
}

// The stream waits for the prefetch in the GPU, not on the host: the kernel is enqueued while the
// chunks are still being read from NVMe and still sees every byte.
TEST_F(GpuTest, KernelsEnqueuedAfterAStreamWaitSeeThePrefetchedData) {
  constexpr uint64_t kSize = 128 << 20;
  auto set = client_->Allocate(std::vector<ChunkSpec>(2, ChunkSpec{.size = kSize}));
  ASSERT_TRUE(set.ok());
  auto up = client_->Prefetch(set->ids(), Tier::kDevice);
  ASSERT_TRUE(up.ok() && up->Wait().ok());
  {
    auto d = client_->Acquire(set->ids(), Tier::kDevice, AccessMode::kWrite);
    ASSERT_TRUE(d.ok());
    for (size_t i = 0; i < d->size(); ++i) {
      ASSERT_EQ(kernels::FillPattern((*d)[i].data, kSize, 7 + i, stream_), cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  auto down = client_->Evict(set->ids(), Tier::kNvme);
  ASSERT_TRUE(down.ok() && down->Wait().ok());
  auto back = client_->Prefetch(set->ids(), Tier::kDevice);
  ASSERT_TRUE(back.ok());
  auto d = client_->Acquire(set->ids(), Tier::kDevice, AccessMode::kRead);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(d->StreamWait(reinterpret_cast<uintptr_t>(stream_)).ok());
  const bool pending_when_enqueued = !d->Ready();
  cudaMemsetAsync(mismatches_, 0, sizeof(unsigned long long), stream_);
  for (size_t i = 0; i < d->size(); ++i) {
    ASSERT_EQ(kernels::CountMismatches((*d)[i].data, kSize, 7 + i, mismatches_, stream_),
              cudaSuccess);
  }
  unsigned long long n = ~0ull;
  cudaMemcpyAsync(&n, mismatches_, sizeof(n), cudaMemcpyDeviceToHost, stream_);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(n, 0u);
  EXPECT_TRUE(d->Wait().ok());
  RecordProperty("pending_when_enqueued", pending_when_enqueued ? 1 : 0);
}

// GPU Adam against the CPU kernels (themselves tested against a float64 reference): the same
// inputs, three steps, tensors with vector tails and one whose pointers are not 16-byte aligned
// (the kernel's scalar path). Needs no daemon.
// The optimizer's device lane on the GPU: a group whose state comes up into the device tier each
// step and is stepped there by GPU Adam, its gradients in device memory or pinned host memory
// (read in place over the link), ends within the kernels' documented difference of the same group
// stepped on the host.
// Bytes the daemon has moved over path `name` ("host_to_device", ...).
uint64_t PathBytes(OffloadedAdam& opt, const char* name) {
  auto info = opt.client().GetNodeInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  const PathStatus* p = info.ok() ? info->path(name) : nullptr;
  return p == nullptr ? 0 : p->bytes;
}

TEST_F(GpuTest, OptimizerGroupsSteppedOnTheGpuMatchTheHostLane) {
  // Gradients in device memory, in pinned host memory, and in device memory with the state kept
  // on the GPU between steps (device_budget_bytes: after the first step none crosses the link).
  for (auto [pinned, kept] : {std::pair{false, false}, {true, false}, {false, true}}) {
    SCOPED_TRACE(
        absl::StrCat(pinned ? "gradients in pinned host memory" : "gradients in device memory",
                     kept ? ", state kept on the GPU" : ""));
    constexpr uint64_t kParams = 3 * 1000003;
    const std::vector<ParamGroup> groups = {{"g", kParams, {}}};
    auto options = [&](const char* name) {
      OffloadedAdamOptions o;
      o.client.socket_dir = daemon_->socket_dir();
      o.name = name;
      o.persistent = false;
      o.host_budget_bytes = 128 << 20;
      o.hyper = {.lr = 1e-2, .weight_decay = 0.01};
      return o;
    };
    auto host = OffloadedAdam::Create(groups, options("host/adam"));
    OffloadedAdamOptions on_gpu_options = options("gpu/adam");
    if (kept) on_gpu_options.device_budget_bytes = 256 << 20;
    auto gpu = OffloadedAdam::Create(groups, on_gpu_options);
    ASSERT_TRUE(host.ok()) << host.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> p(kParams);
    for (float& x : p) x = normal(rng);
    ASSERT_TRUE((*host)->SetParams(0, p).ok());
    ASSERT_TRUE((*gpu)->SetParams(0, p).ok());
    absl::Status placed = (*gpu)->SetGroupPlace(0, StepPlace::kDevice);
    ASSERT_TRUE(placed.ok()) << placed;

    void* grad = nullptr;
    void* out = nullptr;
    if (pinned) {
      ASSERT_EQ(cudaHostAlloc(&grad, kParams * 2, cudaHostAllocDefault), cudaSuccess);
      ASSERT_EQ(cudaHostAlloc(&out, kParams * 2, cudaHostAllocDefault), cudaSuccess);
    } else {
      ASSERT_EQ(cudaMalloc(&grad, kParams * 2), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&out, kParams * 2), cudaSuccess);
    }
    std::vector<uint16_t> g(kParams), out_host(kParams), out_gpu(kParams);
    for (int step = 1; step <= 3; ++step) {
      for (uint16_t& x : g) x = kernels::ToBF16(normal(rng));
      ASSERT_EQ(cudaMemcpy(grad, g.data(), kParams * 2, cudaMemcpyDefault), cudaSuccess);
      for (OffloadedAdam* opt : {host->get(), gpu->get()}) {
        const uint64_t up = PathBytes(*opt, "host_to_device");
        ASSERT_TRUE(opt->BeginStep(4.0f).ok());
        const bool on_gpu = opt == gpu->get();
        absl::Status s = opt->StepGroup(0, on_gpu ? grad : g.data(), ScalarType::kBFloat16,
                                        on_gpu ? out : out_host.data(), ScalarType::kBFloat16);
        ASSERT_TRUE(s.ok()) << s;
        auto stats = opt->FinishStep();
        ASSERT_TRUE(stats.ok()) << stats.status();
        EXPECT_EQ(stats->device_params, on_gpu ? kParams : 0u);
        if (!on_gpu) continue;
        EXPECT_EQ(stats->device_kept_bytes, kept ? stats->state_bytes : 0u);
        const uint64_t moved = PathBytes(*opt, "host_to_device") - up;
        EXPECT_EQ(moved, kept && step > 1 ? 0u : stats->state_bytes) << "step " << step;
      }
    }
    ASSERT_EQ(cudaMemcpy(out_gpu.data(), out, kParams * 2, cudaMemcpyDefault), cudaSuccess);
    std::vector<float> a(kParams), b(kParams);
    ASSERT_TRUE((*host)->GetParams(0, a).ok());
    ASSERT_TRUE((*gpu)->GetParams(0, b).ok());
    // The GPU kernel fuses multiply-adds the CPU kernel may round twice (GpuAdamTest): each
    // weight within 1e-6 of its magnitude plus 1e-7, the bf16 copies within one unit.
    size_t far = 0, far_out = 0;
    for (uint64_t i = 0; i < kParams; ++i) {
      if (std::fabs(a[i] - b[i]) > 1e-6f * std::fabs(a[i]) + 1e-7f) ++far;
      if (std::abs(int{out_host[i]} - int{out_gpu[i]}) > 1) ++far_out;
    }
    EXPECT_EQ(far, 0u);
    EXPECT_EQ(far_out, 0u);
    if (pinned) {
      cudaFreeHost(grad);
      cudaFreeHost(out);
    } else {
      cudaFree(grad);
      cudaFree(out);
    }
  }
}

class GpuAdamTest : public ::testing::TestWithParam<kernels::DType> {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no GPU on this machine: GPU Adam is tested by tests/gpu/run.sh";
    }
  }
};

TEST_P(GpuAdamTest, MatchesTheCpuKernelsOverSeveralTensors) {
  const kernels::DType grad_type = GetParam();
  const std::vector<size_t> sizes = {1, 4099, 200003, 3 * 65536 + 5};
  const size_t misaligned = 2;  // this tensor starts one float past a 16-byte boundary
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  size_t total = 0;
  for (size_t n : sizes) total += n + 4;
  std::vector<float> p(total), m(total), v(total), g32(total);
  for (size_t i = 0; i < total; ++i) {
    p[i] = normal(rng);
    m[i] = 0.1f * normal(rng);
    v[i] = 0.01f * std::fabs(normal(rng)) + 1e-4f;
    g32[i] = normal(rng);
  }
  std::vector<uint16_t> g16(total);
  for (size_t i = 0; i < total; ++i) {
    g16[i] = grad_type == kernels::DType::kF16 ? kernels::ToF16(g32[i]) : kernels::ToBF16(g32[i]);
  }
  const size_t grad_bytes = grad_type == kernels::DType::kF32 ? 4 : 2;
  const void* grad_host = grad_type == kernels::DType::kF32 ? static_cast<const void*>(g32.data())
                                                            : static_cast<const void*>(g16.data());

  float *dp, *dm, *dv;
  void *dg, *dout;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dp), total * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dm), total * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dv), total * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dg, total * grad_bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, total * 2), cudaSuccess);
  cudaMemcpy(dp, p.data(), total * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dm, m.data(), total * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), total * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dg, grad_host, total * grad_bytes, cudaMemcpyHostToDevice);

  std::vector<uint16_t> out(total);
  std::vector<kernels::AdamTensor> cpu;
  std::vector<kernels::GpuAdamTensor> gpu;
  size_t at = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const size_t o = at + (k == misaligned ? 1 : 0);
    cpu.push_back({.param = &p[o],
                   .m = &m[o],
                   .v = &v[o],
                   .grad = static_cast<const char*>(grad_host) + o * grad_bytes,
                   .grad_type = grad_type,
                   .out = &out[o],
                   .out_type = kernels::DType::kBF16,
                   .n = sizes[k]});
    gpu.push_back({.param = dp + o,
                   .m = dm + o,
                   .v = dv + o,
                   .grad = static_cast<const char*>(dg) + o * grad_bytes,
                   .out = static_cast<uint16_t*>(dout) + o,
                   .n = sizes[k]});
    at += sizes[k] + 4;
  }
  const kernels::AdamOptions options{.lr = 1e-2f, .weight_decay = 0.01f, .grad_scale = 4.0f};
  kernels::ThreadPool pool(1, false);
  for (int step = 1; step <= 3; ++step) {
    kernels::AdamStep(cpu, options, step, pool, kernels::Isa::kPortable);
    ASSERT_EQ(kernels::GpuAdamStep(gpu.data(), gpu.size(), grad_type, kernels::DType::kBF16,
                                   options, step, nullptr),
              cudaSuccess);
  }
  std::vector<float> gp(total), gm(total), gv(total);
  std::vector<uint16_t> gout(total);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(gp.data(), dp, total * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gm.data(), dm, total * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gv.data(), dv, total * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(gout.data(), dout, total * 2, cudaMemcpyDeviceToHost);
  // The kernel rounds m, v and the denominator once (fused multiply-add); the portable CPU kernel
  // rounds a*b and then the sum. Where b1*m and (1-b1)*g nearly cancel the two differ by half an
  // ulp of the operands, far above 1e-6 of the (tiny) result, so each element is held to 1e-6 of
  // its own magnitude plus 1e-6 of its array's RMS, and each array to 1e-6 of its norm.
  auto rms = [&](const std::vector<float>& a) {
    double sum = 0;
    size_t count = 0;
    for (const kernels::AdamTensor& t : cpu) {
      for (size_t i = 0; i < t.n; ++i, ++count) {
        const double x = a[static_cast<size_t>(&t.param[i] - p.data())];
        sum += x * x;
      }
    }
    return std::sqrt(sum / static_cast<double>(count));
  };
  const double p_rms = rms(p), m_rms = rms(m), v_rms = rms(v);
  double p_err = 0, m_err = 0, v_err = 0;
  size_t checked = 0;
  for (const kernels::AdamTensor& t : cpu) {
    for (size_t i = 0; i < t.n; ++i) {
      const size_t j = static_cast<size_t>(&t.param[i] - p.data());
      ASSERT_NEAR(gp[j], p[j], 1e-6 * (std::fabs(p[j]) + p_rms)) << "param " << j;
      ASSERT_NEAR(gm[j], m[j], 1e-6 * (std::fabs(m[j]) + m_rms)) << "m " << j;
      ASSERT_NEAR(gv[j], v[j], 1e-6 * (std::fabs(v[j]) + v_rms)) << "v " << j;
      ASSERT_EQ(gout[j], kernels::ToBF16(gp[j])) << "bf16 weights " << j;
      p_err += (double(gp[j]) - p[j]) * (double(gp[j]) - p[j]);
      m_err += (double(gm[j]) - m[j]) * (double(gm[j]) - m[j]);
      v_err += (double(gv[j]) - v[j]) * (double(gv[j]) - v[j]);
      ++checked;
    }
  }
  const double n = static_cast<double>(checked);
  EXPECT_LE(std::sqrt(p_err / n), 1e-6 * p_rms);
  EXPECT_LE(std::sqrt(m_err / n), 1e-6 * m_rms);
  EXPECT_LE(std::sqrt(v_err / n), 1e-6 * v_rms);
  EXPECT_EQ(checked, 4099 + 200003 + 3 * 65536 + 5 + 1u);

  int* finite;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&finite), sizeof(int)), cudaSuccess);
  auto all_finite = [&] {
    int result = 1;
    cudaMemcpy(finite, &result, sizeof(int), cudaMemcpyHostToDevice);
    EXPECT_EQ(kernels::GpuGradientsFinite(gpu.data(), gpu.size(), grad_type, finite, nullptr),
              cudaSuccess);
    cudaMemcpy(&result, finite, sizeof(int), cudaMemcpyDeviceToHost);
    return result;
  };
  EXPECT_EQ(all_finite(), 1);
  const uint16_t inf16 = grad_type == kernels::DType::kF16 ? 0x7C00 : 0x7F80;
  const float inf32 = INFINITY;
  cudaMemcpy(static_cast<char*>(dg) + (total - 7) * grad_bytes,
             grad_type == kernels::DType::kF32 ? static_cast<const void*>(&inf32) : &inf16,
             grad_bytes, cudaMemcpyHostToDevice);
  EXPECT_EQ(all_finite(), 0);
  for (void* ptr : {static_cast<void*>(dp), static_cast<void*>(dm), static_cast<void*>(dv), dg,
                    dout, static_cast<void*>(finite)}) {
    cudaFree(ptr);
  }
}

INSTANTIATE_TEST_SUITE_P(GradTypes, GpuAdamTest,
                         ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16,
                                           kernels::DType::kF16));

}  // namespace
}  // namespace tierd
