// tierd-bench gpu-adam: the GPU Adam kernel's achieved memory bandwidth beside a device-to-device
// copy of the same bytes (the bound) and torch's fused AdamW on the same sizes.
//
//   tierd-bench gpu-adam [--json] [--params=1e7,1e8,1e9] [--iterations=20] [--no_torch]
//
// Bytes per parameter: p, m, v read and written (24), the gradient read (4 in fp32, 2 in bf16)
// and, with bf16 gradients, the bf16 weight copy written (2). The copy moves the same total: half
// of it read, half written. torch's fused AdamW takes fp32 gradients, so the comparison row is
// fp32.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_util.h"
#include "kernels/gpu_adam.h"

namespace tierd::bench {
namespace {

struct GpuAdamOptions {
  bool json = false;
  std::vector<uint64_t> params = {10'000'000, 100'000'000, 1'000'000'000};
  int iterations = 20;
  bool torch = true;
};

bool ParseGpuAdam(int argc, char** argv, GpuAdamOptions* o) {
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    std::string v;
    auto flag = [&](const char* name, std::string* value) {
      if (!absl::StartsWith(a, name)) return false;
      *value = a.substr(std::string(name).size());
      return true;
    };
    if (a == "--json") {
      o->json = true;
    } else if (a == "--no_torch") {
      o->torch = false;
    } else if (flag("--params=", &v)) {
      o->params.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) {
        double x;
        if (!absl::SimpleAtod(p, &x) || x < 1e4) return false;
        o->params.push_back(static_cast<uint64_t>(x));
      }
    } else if (flag("--iterations=", &v)) {
      if (!absl::SimpleAtoi(v, &o->iterations) || o->iterations < 1) return false;
    } else {
      std::fprintf(stderr, "tierd-bench gpu-adam: unknown or malformed option '%s'\n", argv[i]);
      return false;
    }
  }
  return true;
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    Die(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e))), "CUDA");
  }
}

// Device buffers for one size, cut into tensors of 4 Mi elements as a model's layers are.
class State {
 public:
  explicit State(uint64_t n) : n_(n) {
    Check(cudaMalloc(reinterpret_cast<void**>(&p_), n * 4), "cudaMalloc");
    Check(cudaMalloc(reinterpret_cast<void**>(&m_), n * 4), "cudaMalloc");
    Check(cudaMalloc(reinterpret_cast<void**>(&v_), n * 4), "cudaMalloc");
    Check(cudaMalloc(&grad_, n * 4), "cudaMalloc");
    Check(cudaMalloc(&out_, n * 2), "cudaMalloc");
    // Values that keep the step finite and busy (not zeros): the gradient's bytes double as bf16.
    Check(cudaMemset(p_, 0x3c, n * 4), "cudaMemset");
    Check(cudaMemset(m_, 0, n * 4), "cudaMemset");
    Check(cudaMemset(v_, 0, n * 4), "cudaMemset");
    Check(cudaMemset(grad_, 0x3b, n * 4), "cudaMemset");
    constexpr uint64_t kTensor = 4ull << 20;
    for (uint64_t first = 0; first < n; first += kTensor) {
      tensors_.push_back({.param = p_ + first,
                          .m = m_ + first,
                          .v = v_ + first,
                          .grad = static_cast<char*>(grad_) + first * 4,
                          .out = static_cast<char*>(out_) + first * 2,
                          .n = std::min(kTensor, n - first)});
    }
  }
  ~State() {
    cudaFree(p_);
    cudaFree(m_);
    cudaFree(v_);
    cudaFree(grad_);
    cudaFree(out_);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // One step over every tensor; bf16 gradients read the first half of each fp32 gradient's bytes.
  void Step(kernels::DType grad, int64_t step) {
    std::vector<kernels::GpuAdamTensor> t = tensors_;
    if (grad == kernels::DType::kF32) {
      for (kernels::GpuAdamTensor& x : t) x.out = nullptr;
    }
    const kernels::AdamOptions options{.lr = 1e-3, .weight_decay = 0.01, .decoupled = true};
    Check(kernels::GpuAdamStep(t.data(), t.size(), grad, kernels::DType::kBF16, options, step,
                               nullptr),
          "GpuAdamStep");
  }
  // A device-to-device copy moving `bytes` in all (half read, half written), round p, m and v.
  void Copy(uint64_t bytes) {
    float* ring[] = {p_, m_, v_};
    uint64_t left = bytes / 2;
    for (int i = 0; left > 0; i = (i + 1) % 3) {
      const uint64_t b = std::min<uint64_t>(left, n_ * 4);
      Check(cudaMemcpyAsync(ring[(i + 1) % 3], ring[i], b, cudaMemcpyDeviceToDevice, nullptr),
            "cudaMemcpyAsync");
      left -= b;
    }
  }

 private:
  uint64_t n_;
  float *p_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  void *grad_ = nullptr, *out_ = nullptr;
  std::vector<kernels::GpuAdamTensor> tensors_;
};

// Median seconds of `iterations` launches of fn, each timed with events, after two untimed.
template <typename F>
double MedianGpuSeconds(int iterations, F&& fn) {
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  fn();
  fn();
  std::vector<double> t;
  for (int i = 0; i < iterations; ++i) {
    Check(cudaEventRecord(start, nullptr), "cudaEventRecord");
    fn();
    Check(cudaEventRecord(stop, nullptr), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    t.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(t);
}

}  // namespace

int GpuAdam(int argc, char** argv) {
  GpuAdamOptions o;
  if (!ParseGpuAdam(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: tierd-bench gpu-adam [--json] [--params=1e7,1e8,1e9] [--iterations=20] "
                 "[--no_torch]\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "tierd-bench gpu-adam: no GPU on this machine\n");
    return 1;
  }
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  Reporter out("gpu-adam", o.json);
  if (!o.json) std::printf("gpu-adam on %s\n", prop.name);
  for (uint64_t n : o.params) {
    State state(n);
    for (kernels::DType grad : {kernels::DType::kF32, kernels::DType::kBF16}) {
      const bool bf16 = grad == kernels::DType::kBF16;
      const uint64_t bytes = n * (24 + (bf16 ? 2 + 2 : 4));
      int64_t step = 1;
      const double adam_s = MedianGpuSeconds(o.iterations, [&] { state.Step(grad, step++); });
      const double copy_s = MedianGpuSeconds(o.iterations, [&] { state.Copy(bytes); });
      const std::string fields =
          absl::StrFormat(",\"params\":%llu,\"grad_dtype\":\"%s\"",
                          static_cast<unsigned long long>(n), bf16 ? "bf16" : "f32");
      out.Add({"params_per_s", n / adam_s, "/s", fields + ",\"impl\":\"tierd\"",
               absl::StrFormat("%s grads, %llu params: %.0f GB/s, %.2fx the copy's %.0f GB/s",
                               bf16 ? "bf16" : "fp32", static_cast<unsigned long long>(n),
                               bytes / adam_s / 1e9, copy_s / adam_s, bytes / copy_s / 1e9)});
      out.Add({"params_per_s", n / copy_s, "/s", fields + ",\"impl\":\"d2d_copy\"",
               "a device-to-device copy of the same bytes"});
      if (o.torch && !bf16) {
        std::string why;
        const double torch = TorchParamsPerSecond(n, 0, o.iterations, "cuda", &why);
        if (torch > 0) {
          out.Add({"params_per_s", torch, "/s", fields + ",\"impl\":\"torch\"",
                   absl::StrFormat("torch fused AdamW; tierd is %.2fx", n / adam_s / torch)});
        } else if (!o.json) {
          std::printf("  torch: %s\n", why.c_str());
        }
      }
    }
  }
  return 0;
}

}  // namespace tierd::bench
