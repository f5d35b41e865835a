// The portable Adam kernel (one float at a time; the compiler may vectorize it for the baseline
// target) and the scalar bf16/fp16 conversions.
#include <cstring>

#include "kernels/adam_types.h"  // the conversions it defines

namespace tierd::kernels {

float FromBF16(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t ToBF16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float FromF16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {  // inf, NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t ToF16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to infinity (or is infinite)
  if (abs < 0x38800000u) {                        // below the smallest normal: a subnormal or zero
    if (abs < 0x33000000u) return sign;           // below half the smallest subnormal
    // In units of the smallest subnormal, 2^-24.
    const uint32_t shift = 126 - (abs >> 23);
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

namespace {

struct Vec {
  using R = float;
  static constexpr size_t kWidth = 1;
  static R Set1(float x) { return x; }
  static R LoadF32(const float* p) { return *p; }
  static R LoadBF16(const uint16_t* p) { return FromBF16(*p); }
  static R LoadF16(const uint16_t* p) { return FromF16(*p); }
  static void StoreF32(float* p, R x) { *p = x; }
  static void StoreBF16(uint16_t* p, R x) { *p = ToBF16(x); }
  static void StoreF16(uint16_t* p, R x) { *p = ToF16(x); }
  using I = uint32_t;
  static I RoundingBits(uint32_t i, uint32_t seed) { return kernels::RoundingBits(i, seed); }
  static I High16(I r) { return r >> 16; }
  static void StoreBF16Stochastic(uint16_t* p, R x, I random) { *p = ToBF16Stochastic(x, random); }
  static R Sub(R a, R b) { return a - b; }
  static R Mul(R a, R b) { return a * b; }
  static R Div(R a, R b) { return a / b; }
  static R Fma(R a, R b, R c) { return a * b + c; }
  static R Sqrt(R a) { return __builtin_sqrtf(a); }
  static bool AnyNonFinite(R a) { return !(a - a == 0.0f); }
};

}  // namespace
}  // namespace tierd::kernels

#define TIERD_ADAM_NS portable
#include "kernels/adam_impl.h"
