// The Adam kernel body, written once over a vector type and compiled once per instruction set:
// each of adam_portable.cc, adam_avx2.cc and adam_avx512.cc defines `Vec` (its registers and
// operations) and TIERD_ADAM_NS, then includes this file, so every instantiation lives in its own
// namespace and is built with its own compiler flags. Nothing here calls into std:: (an inline
// library function built with AVX-512 flags could be chosen by the linker for every caller).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/adam_types.h"

namespace tierd::kernels {

// A step's constants, computed once per step (cpu_adam.cc).
struct AdamConsts {
  float inv_scale;  // 1 / grad_scale
  float b1, one_minus_b1, b2, one_minus_b2;
  float decay_mult;    // AdamW: 1 - lr * weight_decay; Adam: 1
  float l2;            // Adam: weight_decay; AdamW: 0
  float step_size;     // lr / (1 - beta1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^step)
  float eps;
  int64_t step;  // seeds bf16 state's rounding
};

// The constants of step `step` (from 1) under `options` (cpu_adam.cc; the GPU kernel uses them
// too).
AdamConsts MakeAdamConsts(const AdamOptions& options, int64_t step);

// The entry points each instruction set provides.
struct AdamIsa {
  void (*update)(const AdamTensor& t, size_t begin, size_t end, const AdamConsts& c);
  bool (*finite)(const AdamTensor& t, size_t begin, size_t end);     // the gradients in the range
  void (*bandwidth)(const AdamTensor& t, size_t begin, size_t end);  // BandwidthPass
};

namespace portable {
extern const AdamIsa kIsa;
}
namespace avx2 {
extern const AdamIsa kIsa;
}
namespace avx512 {
extern const AdamIsa kIsa;
}

}  // namespace tierd::kernels

#ifdef TIERD_ADAM_NS
namespace tierd::kernels::TIERD_ADAM_NS {
namespace {

inline float ScalarGrad(const AdamTensor& t, size_t i) {
  switch (t.grad_type) {
    case DType::kF32:
      return static_cast<const float*>(t.grad)[i];
    case DType::kBF16:
      return FromBF16(static_cast<const uint16_t*>(t.grad)[i]);
    case DType::kF16:
      return FromF16(static_cast<const uint16_t*>(t.grad)[i]);
  }
  return 0;
}

inline float ScalarState(const void* state, DType type, size_t i) {
  return type == DType::kBF16 ? FromBF16(static_cast<const uint16_t*>(state)[i])
                              : static_cast<const float*>(state)[i];
}

inline void ScalarUpdate(const AdamTensor& t, size_t i, const AdamConsts& c, uint32_t seed) {
  float g = ScalarGrad(t, i) * c.inv_scale;
  float p = t.param[i];
  g = c.l2 * p + g;
  p = p * c.decay_mult;
  const float m = c.b1 * ScalarState(t.m, t.state_type, i) + c.one_minus_b1 * g;
  const float v = c.b2 * ScalarState(t.v, t.state_type, i) + c.one_minus_b2 * (g * g);
  const float denom = __builtin_sqrtf(v) * c.inv_sqrt_bc2 + c.eps;
  p = p - c.step_size * (m / denom);
  t.param[i] = p;
  if (t.state_type == DType::kBF16) {
    const uint32_t random = RoundingBits(static_cast<uint32_t>(i), seed);
    static_cast<uint16_t*>(t.m)[i] = ToBF16Stochastic(m, random);
    static_cast<uint16_t*>(t.v)[i] = ToBF16Stochastic(v, random >> 16);
  } else {
    static_cast<float*>(t.m)[i] = m;
    static_cast<float*>(t.v)[i] = v;
  }
  if (t.out != nullptr) {
    static_cast<uint16_t*>(t.out)[i] = t.out_type == DType::kF16 ? ToF16(p) : ToBF16(p);
  }
}

template <DType G>
inline typename Vec::R LoadGrad(const void* grad, size_t i) {
  if constexpr (G == DType::kF32) {
    return Vec::LoadF32(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBF16) {
    return Vec::LoadBF16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return Vec::LoadF16(static_cast<const uint16_t*>(grad) + i);
  }
}

template <DType S>
inline typename Vec::R LoadState(const void* state, size_t i) {
  if constexpr (S == DType::kBF16) {
    return Vec::LoadBF16(static_cast<const uint16_t*>(state) + i);
  } else {
    return Vec::LoadF32(static_cast<const float*>(state) + i);
  }
}

// The fused pass: reads p, g, m, v once and writes p, m, v (and the low-precision copy) once.
template <DType G, DType S>
void UpdateVectors(const AdamTensor& t, size_t begin, size_t end, const AdamConsts& c,
                   uint32_t seed) {
  using R = typename Vec::R;
  const R inv_scale = Vec::Set1(c.inv_scale), b1 = Vec::Set1(c.b1), b2 = Vec::Set1(c.b2);
  const R one_minus_b1 = Vec::Set1(c.one_minus_b1), one_minus_b2 = Vec::Set1(c.one_minus_b2);
  const R decay_mult = Vec::Set1(c.decay_mult), l2 = Vec::Set1(c.l2);
  const R step_size = Vec::Set1(c.step_size), inv_sqrt_bc2 = Vec::Set1(c.inv_sqrt_bc2);
  const R eps = Vec::Set1(c.eps);
  for (size_t i = begin; i < end; i += Vec::kWidth) {
    R g = Vec::Mul(LoadGrad<G>(t.grad, i), inv_scale);
    R p = Vec::LoadF32(t.param + i);
    g = Vec::Fma(l2, p, g);
    p = Vec::Mul(p, decay_mult);
    const R m = Vec::Fma(b1, LoadState<S>(t.m, i), Vec::Mul(one_minus_b1, g));
    const R v = Vec::Fma(b2, LoadState<S>(t.v, i), Vec::Mul(one_minus_b2, Vec::Mul(g, g)));
    const R denom = Vec::Fma(Vec::Sqrt(v), inv_sqrt_bc2, eps);
    p = Vec::Sub(p, Vec::Mul(step_size, Vec::Div(m, denom)));
    Vec::StoreF32(t.param + i, p);
    if constexpr (S == DType::kBF16) {
      const typename Vec::I random = Vec::RoundingBits(static_cast<uint32_t>(i), seed);
      Vec::StoreBF16Stochastic(static_cast<uint16_t*>(t.m) + i, m, random);
      Vec::StoreBF16Stochastic(static_cast<uint16_t*>(t.v) + i, v, Vec::High16(random));
    } else {
      Vec::StoreF32(static_cast<float*>(t.m) + i, m);
      Vec::StoreF32(static_cast<float*>(t.v) + i, v);
    }
    if (t.out != nullptr) {
      uint16_t* out = static_cast<uint16_t*>(t.out) + i;
      if (t.out_type == DType::kF16) {
        Vec::StoreF16(out, p);
      } else {
        Vec::StoreBF16(out, p);
      }
    }
  }
}

template <DType S>
void UpdateState(const AdamTensor& t, size_t begin, size_t end, const AdamConsts& c,
                 uint32_t seed) {
  switch (t.grad_type) {
    case DType::kF32:
      UpdateVectors<DType::kF32, S>(t, begin, end, c, seed);
      break;
    case DType::kBF16:
      UpdateVectors<DType::kBF16, S>(t, begin, end, c, seed);
      break;
    case DType::kF16:
      UpdateVectors<DType::kF16, S>(t, begin, end, c, seed);
      break;
  }
}

void Update(const AdamTensor& t, size_t begin, size_t end, const AdamConsts& c) {
  const size_t vector_end = begin + (end - begin) / Vec::kWidth * Vec::kWidth;
  const uint32_t seed = StepSeed(t.seed, c.step);
  if (t.state_type == DType::kBF16) {
    UpdateState<DType::kBF16>(t, begin, vector_end, c, seed);
  } else {
    UpdateState<DType::kF32>(t, begin, vector_end, c, seed);
  }
  for (size_t i = vector_end; i < end; ++i) ScalarUpdate(t, i, c, seed);
}

bool Finite(const AdamTensor& t, size_t begin, size_t end) {
  const size_t vector_end = begin + (end - begin) / Vec::kWidth * Vec::kWidth;
  bool bad = false;
  for (size_t i = begin; i < vector_end; i += Vec::kWidth) {
    typename Vec::R g = Vec::Set1(0.0f);
    switch (t.grad_type) {
      case DType::kF32:
        g = LoadGrad<DType::kF32>(t.grad, i);
        break;
      case DType::kBF16:
        g = LoadGrad<DType::kBF16>(t.grad, i);
        break;
      case DType::kF16:
        g = LoadGrad<DType::kF16>(t.grad, i);
        break;
    }
    bad |= Vec::AnyNonFinite(g);
  }
  for (size_t i = vector_end; i < end; ++i) {
    const float g = ScalarGrad(t, i);
    bad |= !(g - g == 0.0f);
  }
  return !bad;
}

// The same loads and stores as UpdateVectors with one multiply-add per array in between (bf16
// state rounded to nearest: the bound counts bytes, not rounding).
template <DType S>
inline void StoreState(void* state, size_t i, typename Vec::R x) {
  if constexpr (S == DType::kBF16) {
    Vec::StoreBF16(static_cast<uint16_t*>(state) + i, x);
  } else {
    Vec::StoreF32(static_cast<float*>(state) + i, x);
  }
}

template <DType G, DType S>
void BandwidthVectors(const AdamTensor& t, size_t begin, size_t end) {
  using R = typename Vec::R;
  const R s = Vec::Set1(1e-7f);
  for (size_t i = begin; i < end; i += Vec::kWidth) {
    const R g = LoadGrad<G>(t.grad, i);
    Vec::StoreF32(t.param + i, Vec::Fma(s, g, Vec::LoadF32(t.param + i)));
    StoreState<S>(t.m, i, Vec::Fma(s, g, LoadState<S>(t.m, i)));
    StoreState<S>(t.v, i, Vec::Fma(s, g, LoadState<S>(t.v, i)));
  }
}

template <DType S>
void BandwidthState(const AdamTensor& t, size_t begin, size_t end) {
  switch (t.grad_type) {
    case DType::kF32:
      BandwidthVectors<DType::kF32, S>(t, begin, end);
      break;
    case DType::kBF16:
      BandwidthVectors<DType::kBF16, S>(t, begin, end);
      break;
    case DType::kF16:
      BandwidthVectors<DType::kF16, S>(t, begin, end);
      break;
  }
}

void Bandwidth(const AdamTensor& t, size_t begin, size_t end) {
  const size_t vector_end = begin + (end - begin) / Vec::kWidth * Vec::kWidth;
  if (t.state_type == DType::kBF16) {
    BandwidthState<DType::kBF16>(t, begin, vector_end);
  } else {
    BandwidthState<DType::kF32>(t, begin, vector_end);
  }
  for (size_t i = vector_end; i < end; ++i) {
    const float g = ScalarGrad(t, i) * 1e-7f;
    t.param[i] += g;
    if (t.state_type == DType::kBF16) {
      uint16_t* m = static_cast<uint16_t*>(t.m);
      uint16_t* v = static_cast<uint16_t*>(t.v);
      m[i] = ToBF16(FromBF16(m[i]) + g);
      v[i] = ToBF16(FromBF16(v[i]) + g);
    } else {
      static_cast<float*>(t.m)[i] += g;
      static_cast<float*>(t.v)[i] += g;
    }
  }
}

}  // namespace

const AdamIsa kIsa = {&Update, &Finite, &Bandwidth};

}  // namespace tierd::kernels::TIERD_ADAM_NS
#endif  // TIERD_ADAM_NS
