#include "kernels/cpu_adam.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <vector>

#include "kernels/adam_impl.h"

namespace tierd::kernels {
namespace {

const AdamIsa& Kernels(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512::kIsa;
    case Isa::kAvx2:
      return avx2::kIsa;
    case Isa::kPortable:
      break;
  }
  return portable::kIsa;
}

// Worker w's share of the tensors' elements, laid end to end: a contiguous range, cut at multiples
// of 64 elements (whole cache lines of p, m and v), the same every step.
template <typename Fn>
void ForShare(std::span<const AdamTensor> tensors, int worker, int workers, Fn fn) {
  size_t total = 0;
  for (const AdamTensor& t : tensors) total += t.n;
  auto cut = [&](int w) {
    const size_t at = static_cast<size_t>(static_cast<double>(total) * w / workers);
    return w == workers ? total : at / 64 * 64;
  };
  const size_t begin = cut(worker), end = cut(worker + 1);
  size_t base = 0;
  for (const AdamTensor& t : tensors) {
    const size_t lo = std::max(begin, base), hi = std::min(end, base + t.n);
    if (lo < hi) fn(t, lo - base, hi - base);
    base += t.n;
    if (base >= end) break;
  }
}

// Workers for a job over these tensors: one per kMinElementsPerWorker elements, at most the pool.
// Waking a worker costs tens of microseconds; a share smaller than this would spend more on the
// wake-up than on the work (a 19 K-element shard on 16 workers took 6x as long as on one).
constexpr size_t kMinElementsPerWorker = 64 * 1024;

int WorkersFor(std::span<const AdamTensor> tensors, const ThreadPool& pool) {
  size_t total = 0;
  for (const AdamTensor& t : tensors) total += t.n;
  return static_cast<int>(
      std::clamp<size_t>(total / kMinElementsPerWorker, 1, static_cast<size_t>(pool.size())));
}

// Runs fn(tensor, lo, hi) over every worker's share, on as many workers as the size warrants.
template <typename Fn>
void ForAllShares(std::span<const AdamTensor> tensors, ThreadPool& pool, Fn fn) {
  const int workers = WorkersFor(tensors, pool);
  pool.Run(workers, [&](int w) { ForShare(tensors, w, workers, fn); });
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c".
bool HasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}

bool Supported(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && Supported(Isa::kAvx2);
  }
  return false;
}

Isa BestIsa() {
  static const Isa best = Supported(Isa::kAvx512) ? Isa::kAvx512
                          : Supported(Isa::kAvx2) ? Isa::kAvx2
                                                  : Isa::kPortable;
  return best;
}

AdamConsts MakeAdamConsts(const AdamOptions& o, int64_t step) {
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(step));
  auto f = [](double x) { return static_cast<float>(x); };
  return AdamConsts{
      .inv_scale = f(1.0 / o.grad_scale),
      .b1 = f(o.beta1),
      .one_minus_b1 = f(1.0 - o.beta1),
      .b2 = f(o.beta2),
      .one_minus_b2 = f(1.0 - o.beta2),
      .decay_mult = o.decoupled ? f(1.0 - o.lr * o.weight_decay) : 1.0f,
      .l2 = o.decoupled ? 0.0f : f(o.weight_decay),
      .step_size = f(o.lr / bc1),
      .inv_sqrt_bc2 = f(1.0 / std::sqrt(bc2)),
      .eps = f(o.eps),
      .step = step,
  };
}

bool GradientsFinite(std::span<const AdamTensor> tensors, ThreadPool& pool, Isa isa) {
  assert(Supported(isa));
  const AdamIsa& k = Kernels(isa);
  std::atomic<bool> finite{true};
  ForAllShares(tensors, pool, [&](const AdamTensor& t, size_t lo, size_t hi) {
    if (finite.load(std::memory_order_relaxed) && !k.finite(t, lo, hi)) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  return finite.load();
}

void AdamStep(std::span<const AdamTensor> tensors, const AdamOptions& o, int64_t step,
              ThreadPool& pool, Isa isa) {
  assert(Supported(isa) && step >= 1);
  // Each tensor's constants: its own step's bias correction where it has one.
  std::vector<AdamConsts> consts;
  consts.reserve(tensors.size());
  for (const AdamTensor& t : tensors) {
    assert(t.state_type == DType::kF32 || t.state_type == DType::kBF16);
    assert(t.step >= 0);
    consts.push_back(MakeAdamConsts(o, t.step != 0 ? t.step : step));
  }
  const AdamIsa& k = Kernels(isa);
  ForAllShares(tensors, pool, [&](const AdamTensor& t, size_t lo, size_t hi) {
    k.update(t, lo, hi, consts[static_cast<size_t>(&t - tensors.data())]);
  });
}

void BandwidthPass(std::span<const AdamTensor> tensors, ThreadPool& pool, Isa isa) {
  assert(Supported(isa));
  const AdamIsa& k = Kernels(isa);
  ForAllShares(tensors, pool,
               [&](const AdamTensor& t, size_t lo, size_t hi) { k.bandwidth(t, lo, hi); });
}

}  // namespace tierd::kernels
