// The types of the CPU Adam kernels (kernels/cpu_adam.h), apart so that the per-instruction-set
// kernel files include nothing else.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tierd::kernels {

enum class DType : uint8_t { kF32, kBF16, kF16 };

// Hyperparameters in double, as the frameworks keep them: 1 - beta2 computed from a float beta2
// of 0.999 is 0.00099998713, 1.3e-5 off the intended 0.001. The kernels get each constant rounded
// once to float (MakeAdamConsts).
struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // AdamW: the decay shrinks the weights directly (p *= 1 - lr * weight_decay). Adam (false):
  // the decay is added to the gradient (g += weight_decay * p), as torch.optim.Adam does.
  bool decoupled = true;
  // Gradients arrive multiplied by this (loss scaling); the step divides it out.
  double grad_scale = 1.0;
};

// One parameter tensor and its state. `m` and `v` hold n values of `state_type`; `grad` holds n
// values of `grad_type`; `out`, when set, gets the updated weights as n values of `out_type`
// (kBF16 or kF16).
//
// bf16 moments (state_type kBF16) are rounded stochastically: each new value is rounded up or down
// to a neighbouring bf16 with a probability in proportion to its distance, so it is right on
// average. Rounded to nearest, v would stop decaying (v * 0.999 rounds back to v whenever the
// change is below half a bf16 ulp, 1/512 of v) and the step sizes would drift. The random bits
// come from a hash of (seed, step, element index): the same for every instruction set and thread
// count, and different at every step, so a step is reproducible and its rounding unbiased.
struct AdamTensor {
  float* param = nullptr;
  void* m = nullptr;
  void* v = nullptr;
  const void* grad = nullptr;
  DType grad_type = DType::kF32;
  void* out = nullptr;
  DType out_type = DType::kBF16;
  size_t n = 0;
  DType state_type = DType::kF32;  // kF32 or kBF16
  uint32_t seed = 0;               // tells tensors' rounding apart (bf16 state)
  // This tensor's step (from 1), for its bias correction and rounding, when tensors stepped
  // together have taken different numbers of steps (torch counts steps per parameter); 0: the
  // step the call is given.
  int64_t step = 0;
};

// bf16 and fp16 conversions with round-to-nearest-even, as the kernels do them (out of line, in
// adam_portable.cc: the kernels call them for the elements a vector does not fill).
uint16_t ToBF16(float x);
float FromBF16(uint16_t x);
uint16_t ToF16(float x);
float FromF16(uint16_t x);

// The stochastic rounding's random bits for element `i` under a step's `seed` (a 32-bit integer
// hash, "lowbias32" from Wellons' hash prospector): bits 0-15 round m, bits 16-31 round v.
inline uint32_t RoundingBits(uint32_t i, uint32_t seed) {
  uint32_t h = i * 0x9e3779b1u + seed;
  h ^= h >> 16;
  h *= 0x21f0aaadu;
  h ^= h >> 15;
  h *= 0x735a2d97u;
  h ^= h >> 15;
  return h;
}
// x rounded to bf16 up or down by `random` (16 bits): bf16(x) is the upper half of x's bits, and
// adding random to the lower half carries into it with a probability equal to the fraction cut
// off. NaN stays NaN.
inline uint16_t ToBF16Stochastic(float x, uint32_t random) {
  uint32_t bits = __builtin_bit_cast(uint32_t, x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += random & 0xffffu;
  return static_cast<uint16_t>(bits >> 16);
}
// The seed of a step for a tensor seeded `seed`.
inline uint32_t StepSeed(uint32_t seed, int64_t step) {
  return RoundingBits(static_cast<uint32_t>(step), RoundingBits(seed, 0x5bd1e995u));
}

}  // namespace tierd::kernels
