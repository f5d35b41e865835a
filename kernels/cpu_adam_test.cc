// The CPU Adam kernels against a float64 reference on random data, for every instruction set the
// running CPU has, every gradient type and both weight-decay forms, over several steps.
#include "kernels/cpu_adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tierd::kernels {
namespace {

// The state of one tensor in float64, updated as torch.optim.AdamW / Adam define the step. Beside
// m and v it keeps the same averages of the terms' magnitudes: where a sum cancels (a gradient
// changing sign, or the Adam decay term against the gradient), no fp32 evaluation is within a
// relative 1e-6 of the result, but every correct one is within 1e-6 of the terms' size.
struct Reference {
  std::vector<double> p, m, v, m_size, v_size;

  void Step(const std::vector<float>& grad, const AdamOptions& o, int64_t step) {
    const double bc1 = 1 - std::pow(double{o.beta1}, step);
    const double bc2 = 1 - std::pow(double{o.beta2}, step);
    for (size_t i = 0; i < p.size(); ++i) {
      double g = double{grad[i]} / o.grad_scale;
      double g_size = std::abs(g);
      if (o.decoupled) {
        p[i] *= 1 - double{o.lr} * o.weight_decay;
      } else {
        g += double{o.weight_decay} * p[i];
        g_size += std::abs(double{o.weight_decay} * p[i]);
      }
      m[i] = o.beta1 * m[i] + (1 - double{o.beta1}) * g;
      v[i] = o.beta2 * v[i] + (1 - double{o.beta2}) * g * g;
      m_size[i] = o.beta1 * m_size[i] + (1 - double{o.beta1}) * g_size;
      v_size[i] = o.beta2 * v_size[i] + (1 - double{o.beta2}) * g_size * g_size;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + o.eps;
      p[i] -= double{o.lr} / bc1 * m[i] / denom;
    }
  }
};

struct Case {
  Isa isa;
  DType grad_type;
  bool decoupled;
};

std::string Name(const testing::TestParamInfo<Case>& info) {
  const char* g[] = {"f32", "bf16", "f16"};
  return std::string(IsaName(info.param.isa)) + "_" + g[static_cast<int>(info.param.grad_type)] +
         (info.param.decoupled ? "_adamw" : "_adam");
}

class CpuAdamTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!Supported(GetParam().isa)) GTEST_SKIP() << IsaName(GetParam().isa) << " not on this CPU";
  }
};

// Gradients representable in the type under test, so that the reference sees the same values. At
// least 1e-3 in magnitude, above the Adam decay term (1e-4 * |p|): where the two cancel, or where a
// gradient nears eps, the step's direction is ill-conditioned and any fp32 evaluation may differ
// from float64 by far more than 1e-6 (the test would measure the data, not the kernel).
std::vector<float> Gradients(size_t n, DType type, std::mt19937& rng, std::vector<uint16_t>* raw) {
  std::normal_distribution<float> normal(0.0f, 0.01f);
  std::vector<float> g(n);
  raw->resize(n);
  for (size_t i = 0; i < n; ++i) {
    float x = normal(rng);
    while (std::abs(x) < 1e-3f) x = normal(rng);
    if (type == DType::kBF16) {
      (*raw)[i] = ToBF16(x);
      x = FromBF16((*raw)[i]);
    } else if (type == DType::kF16) {
      (*raw)[i] = ToF16(x);
      x = FromF16((*raw)[i]);
    }
    g[i] = x;
  }
  return g;
}

TEST_P(CpuAdamTest, MatchesAFloat64ReferenceOverSeveralSteps) {
  const Case c = GetParam();
  // Sizes that leave vector tails, in two tensors stepped together, large enough that the job is
  // shared by all three workers (one per 64 Ki elements), one share crossing the tensors' border.
  const std::vector<size_t> sizes = {200'003, 4'099};
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> magnitude(0.5f, 1.5f);
  std::bernoulli_distribution negative(0.5);
  AdamOptions o{.lr = 1e-3f, .weight_decay = 1e-4f, .decoupled = c.decoupled, .grad_scale = 1024};

  std::vector<std::vector<float>> p(2), m(2), v(2), g(2);
  std::vector<std::vector<uint16_t>> raw(2), out(2);
  std::vector<Reference> ref(2);
  for (size_t t = 0; t < 2; ++t) {
    for (size_t i = 0; i < sizes[t]; ++i) {
      const float x = magnitude(rng) * (negative(rng) ? -1.0f : 1.0f);
      p[t].push_back(x);
      ref[t].p.push_back(x);
    }
    m[t].assign(sizes[t], 0.0f);
    v[t].assign(sizes[t], 0.0f);
    ref[t].m.assign(sizes[t], 0.0);
    ref[t].v.assign(sizes[t], 0.0);
    ref[t].m_size.assign(sizes[t], 0.0);
    ref[t].v_size.assign(sizes[t], 0.0);
    out[t].assign(sizes[t], 0);
  }
  ThreadPool pool(3);
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<AdamTensor> tensors;
    for (size_t t = 0; t < 2; ++t) {
      g[t] = Gradients(sizes[t], c.grad_type, rng, &raw[t]);
      std::vector<float> scaled = g[t];
      for (float& x : scaled) x *= o.grad_scale;  // exact: a power of two
      if (c.grad_type == DType::kF32) {
        g[t] = scaled;
      } else {
        for (size_t i = 0; i < sizes[t]; ++i) {
          raw[t][i] = c.grad_type == DType::kBF16 ? ToBF16(scaled[i]) : ToF16(scaled[i]);
        }
        g[t] = scaled;
      }
      tensors.push_back({.param = p[t].data(),
                         .m = m[t].data(),
                         .v = v[t].data(),
                         .grad = c.grad_type == DType::kF32 ? static_cast<const void*>(g[t].data())
                                                            : raw[t].data(),
                         .grad_type = c.grad_type,
                         .out = out[t].data(),
                         .out_type = t == 0 ? DType::kBF16 : DType::kF16,
                         .n = sizes[t]});
      ref[t].Step(g[t], o, step);
    }
    ASSERT_TRUE(GradientsFinite(tensors, pool, c.isa));
    AdamStep(tensors, o, step, pool, c.isa);
    for (size_t t = 0; t < 2; ++t) {
      for (size_t i = 0; i < sizes[t]; ++i) {
        ASSERT_NEAR(p[t][i], ref[t].p[i], 1e-6 * std::abs(ref[t].p[i]))
            << "step " << step << " at " << i;
        ASSERT_NEAR(m[t][i], ref[t].m[i], 1e-6 * ref[t].m_size[i])
            << "step " << step << " at " << i;
        ASSERT_NEAR(v[t][i], ref[t].v[i], 1e-6 * ref[t].v_size[i])
            << "step " << step << " at " << i;
        // The low-precision copy is the fp32 weight rounded to nearest even.
        const uint16_t want = t == 0 ? ToBF16(p[t][i]) : ToF16(p[t][i]);
        ASSERT_EQ(out[t][i], want) << "out at " << i;
      }
    }
  }
}

// torch counts steps per parameter: tensors stepped in one call, each at its own step, are bit for
// bit what stepping each alone at that step gives.
TEST_P(CpuAdamTest, TensorsSteppedTogetherEachTakeTheirOwnStepsBiasCorrection) {
  const Case c = GetParam();
  const size_t n = 70'001;
  std::mt19937 rng(7);
  std::vector<uint16_t> raw;
  const std::vector<float> grad = Gradients(n, DType::kF32, rng, &raw);
  const AdamOptions o{.lr = 1e-2, .weight_decay = 0.1, .decoupled = c.decoupled};
  ThreadPool pool(3);
  struct State {
    std::vector<float> p, m, v;
  };
  auto fresh = [&] {
    return State{std::vector<float>(n, 0.5f), std::vector<float>(n, 0.01f),
                 std::vector<float>(n, 1e-4f)};
  };
  auto tensor = [&](State& s, int64_t step) {
    return AdamTensor{.param = s.p.data(),
                      .m = s.m.data(),
                      .v = s.v.data(),
                      .grad = grad.data(),
                      .n = n,
                      .step = step};
  };
  State together[2] = {fresh(), fresh()}, alone[2] = {fresh(), fresh()};
  const AdamTensor both[2] = {tensor(together[0], 1), tensor(together[1], 40)};
  AdamStep(both, o, /*step=*/7, pool, c.isa);  // each tensor's own step, not 7
  AdamTensor first = tensor(alone[0], 0), second = tensor(alone[1], 0);
  AdamStep({&first, 1}, o, 1, pool, c.isa);
  AdamStep({&second, 1}, o, 40, pool, c.isa);
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(together[t].p, alone[t].p) << "tensor " << t;
    EXPECT_EQ(together[t].m, alone[t].m) << "tensor " << t;
    EXPECT_EQ(together[t].v, alone[t].v) << "tensor " << t;
  }
  EXPECT_NE(together[0].p, together[1].p);  // the two steps' bias corrections differ
}

TEST_P(CpuAdamTest, ANonFiniteGradientIsFoundWherever) {
  const Case c = GetParam();
  const size_t n = 1'037;
  std::vector<float> f32(n, 0.5f);
  std::vector<uint16_t> half(n, c.grad_type == DType::kBF16 ? ToBF16(0.5f) : ToF16(0.5f));
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
  AdamTensor t{.param = p.data(), .m = m.data(), .v = v.data(), .grad_type = c.grad_type, .n = n};
  t.grad = c.grad_type == DType::kF32 ? static_cast<const void*>(f32.data()) : half.data();
  ThreadPool pool(2);
  ASSERT_TRUE(GradientsFinite({&t, 1}, pool, c.isa));
  for (size_t at : {size_t{0}, size_t{17}, n - 1}) {  // in a vector and in the tail
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      f32.assign(n, 0.5f);
      half.assign(n, c.grad_type == DType::kBF16 ? ToBF16(0.5f) : ToF16(0.5f));
      f32[at] = bad;
      half[at] = c.grad_type == DType::kBF16 ? ToBF16(bad) : ToF16(bad);
      EXPECT_FALSE(GradientsFinite({&t, 1}, pool, c.isa)) << bad << " at " << at;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuAdamTest, testing::ValuesIn([] {
                           std::vector<Case> cases;
                           for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
                             for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
                               for (bool decoupled : {true, false})
                                 cases.push_back({isa, g, decoupled});
                             }
                           }
                           return cases;
                         }()),
                         Name);

// bf16 moments (AdamTensor::state_type kBF16), for every instruction set the CPU has.
class Bf16StateTest : public testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!Supported(GetParam())) GTEST_SKIP() << IsaName(GetParam()) << " not on this CPU";
  }
};

// n elements of each of p (fp32), m and v (bf16) and a bf16 gradient.
struct Bf16State {
  std::vector<float> p;
  std::vector<uint16_t> m, v, g;
  explicit Bf16State(size_t n) : p(n), m(n), v(n), g(n) {}
  AdamTensor Tensor(uint32_t seed = 7) {
    return {.param = p.data(),
            .m = m.data(),
            .v = v.data(),
            .grad = g.data(),
            .grad_type = DType::kBF16,
            .n = p.size(),
            .state_type = DType::kBF16,
            .seed = seed};
  }
};

TEST_P(Bf16StateTest, FollowsAFloat64ReferenceWithinBf16Precision) {
  const size_t n = 100'003;  // a vector tail; shared by two workers
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.01f);
  Bf16State s(n);
  Reference ref;
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = 1.0f + normal(rng);
    ref.p.push_back(s.p[i]);
  }
  ref.m.assign(n, 0.0);
  ref.v.assign(n, 0.0);
  ref.m_size.assign(n, 0.0);
  ref.v_size.assign(n, 0.0);
  const AdamOptions o{.lr = 1e-3, .weight_decay = 0.01};
  ThreadPool pool(2);
  std::vector<float> grad(n);
  for (int64_t step = 1; step <= 20; ++step) {
    for (size_t i = 0; i < n; ++i) {
      s.g[i] = ToBF16(normal(rng));
      grad[i] = FromBF16(s.g[i]);
    }
    const AdamTensor t = s.Tensor();
    AdamStep({&t, 1}, o, step, pool, GetParam());
    ref.Step(grad, o, step);
    for (size_t i = 0; i < n; ++i) {
      // Each step rounds m and v once more, to a neighbour less than an ulp (2^-7 of the value)
      // away; earlier errors decay by beta. m's error is then below 2^-7 / (1 - 0.9) of its
      // terms' size, v's below 2^-7 per step taken.
      ASSERT_NEAR(FromBF16(s.m[i]), ref.m[i], ref.m_size[i] / 10) << "step " << step << " at " << i;
      ASSERT_NEAR(FromBF16(s.v[i]), ref.v[i], ref.v_size[i] * static_cast<double>(step) / 128)
          << "step " << step << " at " << i;
      // The weights move by at most lr per step; the moments' errors change the step's size.
      ASSERT_NEAR(s.p[i], ref.p[i], 0.05 * o.lr * static_cast<double>(step))
          << "step " << step << " at " << i;
    }
  }
}

TEST_P(Bf16StateTest, RoundingIsUnbiasedWhereRoundingToNearestWouldStall) {
  // v = 1 and zero gradients: each step multiplies v by 0.999, a change below half a bf16 ulp
  // (2^-9 below 1), so v rounded to nearest would stay 1 forever. Rounded stochastically it decays
  // as it should, on average over the elements.
  const size_t n = 1 << 16;
  Bf16State s(n);
  std::fill(s.p.begin(), s.p.end(), 1.0f);
  std::fill(s.v.begin(), s.v.end(), ToBF16(1.0f));
  std::fill(s.m.begin(), s.m.end(), ToBF16(0.0f));
  std::fill(s.g.begin(), s.g.end(), ToBF16(0.0f));
  ThreadPool pool(2);
  const AdamOptions o{.lr = 0, .weight_decay = 0};
  const int steps = 300;
  for (int step = 1; step <= steps; ++step) {
    const AdamTensor t = s.Tensor();
    AdamStep({&t, 1}, o, step, pool, GetParam());
  }
  double sum = 0;
  for (uint16_t x : s.v) sum += FromBF16(x);
  const double want = std::pow(0.999, steps);  // 0.7407
  EXPECT_NEAR(sum / n, want, 1e-3) << "round to nearest would leave 1";
  EXPECT_EQ(s.p, std::vector<float>(n, 1.0f));
}

TEST_P(Bf16StateTest, AStepIsReproducibleAndEachStepRoundsAfresh) {
  const size_t n = 70'001;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Bf16State start(n);
  for (size_t i = 0; i < n; ++i) {
    start.p[i] = normal(rng);
    start.m[i] = ToBF16(0.1f * normal(rng));
    start.v[i] = ToBF16(0.01f + 0.01f * std::abs(normal(rng)));
    start.g[i] = ToBF16(normal(rng));
  }
  const AdamOptions o{.lr = 1e-3};
  auto run = [&](int threads, int64_t step, uint32_t seed, Isa isa) {
    Bf16State s = start;
    ThreadPool pool(threads);
    const AdamTensor t = s.Tensor(seed);
    AdamStep({&t, 1}, o, step, pool, isa);
    return s;
  };
  const Bf16State one = run(1, 5, 7, GetParam());
  const Bf16State three = run(3, 5, 7, GetParam());
  EXPECT_EQ(one.m, three.m);
  EXPECT_EQ(one.v, three.v);
  EXPECT_EQ(one.p, three.p);
  // Another step (or another tensor's seed) rounds the same values differently.
  for (const Bf16State& other : {run(1, 6, 7, GetParam()), run(1, 5, 8, GetParam())}) {
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) differ += other.m[i] != one.m[i];
    EXPECT_GT(differ, n / 10);
  }
  // The instruction sets agree with the portable kernel, but where an fp32 result differs in its
  // last bit (a fused multiply-add) and so rounds differently: in a few elements, by an ulp of
  // the terms' size (more of the result's own where the terms cancel).
  const Bf16State portable = run(1, 5, 7, Isa::kPortable);
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) {
    const float g = FromBF16(start.g[i]);
    const double m_terms = 0.9 * std::abs(FromBF16(start.m[i])) + 0.1 * std::abs(g);
    const double v_terms = 0.999 * FromBF16(start.v[i]) + 0.001 * g * g;
    ASSERT_NEAR(FromBF16(one.m[i]), FromBF16(portable.m[i]), m_terms / 64) << i;
    ASSERT_NEAR(FromBF16(one.v[i]), FromBF16(portable.v[i]), v_terms / 64) << i;
    differ += (one.m[i] != portable.m[i]) + (one.v[i] != portable.v[i]);
  }
  EXPECT_LT(differ, n / 100);
}

TEST(Bf16StochasticRoundingTest, RoundsToANeighbourWithTheRightOdds) {
  // 1 + 1/512 lies a quarter of the way from 1 to the next bf16 (1 + 1/128): rounded up for a
  // quarter of the random values.
  const float x = 1.0f + 1.0f / 512;
  int up = 0;
  for (uint32_t r = 0; r < 0x10000; ++r) {
    const uint16_t b = ToBF16Stochastic(x, r);
    ASSERT_TRUE(b == ToBF16(1.0f) || b == ToBF16(1.0f + 1.0f / 128)) << r;
    up += b != ToBF16(1.0f);
  }
  EXPECT_EQ(up, 0x10000 / 4);
  for (uint32_t r : {0u, 0xffffu}) {
    EXPECT_EQ(ToBF16Stochastic(2.0f, r), ToBF16(2.0f));  // exact values stay
    EXPECT_EQ(ToBF16Stochastic(-2.0f, r), ToBF16(-2.0f));
    EXPECT_TRUE(std::isnan(FromBF16(ToBF16Stochastic(std::numeric_limits<float>::quiet_NaN(), r))));
    EXPECT_EQ(FromBF16(ToBF16Stochastic(std::numeric_limits<float>::infinity(), r)),
              std::numeric_limits<float>::infinity());
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Bf16StateTest,
                         testing::Values(Isa::kPortable, Isa::kAvx2, Isa::kAvx512),
                         [](const testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

TEST(ThreadPoolTest, AJobWakesOnlyTheWorkersItAsksFor) {
  ThreadPool pool(4, false);
  ASSERT_EQ(pool.size(), 4);
  // Jobs of every width, in an order that leaves workers behind by several generations and then
  // needs them again: each job runs exactly its workers, each once.
  for (int round = 0; round < 200; ++round) {
    const int asked = (round * 7) % 6;  // 0..5: clamped to 1..4
    std::vector<std::atomic<int>> ran(4);
    pool.Run(asked, [&](int w) { ran[static_cast<size_t>(w)].fetch_add(1); });
    const int expected = std::clamp(asked, 1, 4);
    for (int w = 0; w < 4; ++w) {
      EXPECT_EQ(ran[static_cast<size_t>(w)].load(), w < expected ? 1 : 0)
          << "round " << round << ", worker " << w << ", asked " << asked;
    }
  }
}

TEST(HalfConversionTest, RoundTripsAndRoundsToNearestEven) {
  for (float x : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(FromF16(ToF16(x)), x) << x;
  }
  EXPECT_EQ(ToF16(65520.0f), 0x7c00);                 // overflows to infinity
  EXPECT_EQ(ToF16(1.0f + 1.0f / 2048), ToF16(1.0f));  // a tie goes to the even neighbour
  EXPECT_EQ(ToF16(2.98023224e-08f), 0);               // half the smallest subnormal: to zero
  EXPECT_TRUE(std::isnan(FromF16(ToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FromBF16(ToBF16(1.0f + 1.0f / 256)), 1.0f);  // tie to even
  EXPECT_EQ(FromBF16(ToBF16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  EXPECT_TRUE(std::isnan(FromBF16(ToBF16(std::numeric_limits<float>::quiet_NaN()))));
  // Every half value converts back exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = FromF16(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(ToF16(f), h) << std::hex << h;
  }
}

}  // namespace
}  // namespace tierd::kernels
