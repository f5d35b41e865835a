// The Adam kernel on AVX2 with FMA and F16C (8 floats per register). Built with -mavx2 -mfma
// -mf16c; called only when the running CPU has them (cpu_adam.cc).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace tierd::kernels {
namespace {

struct Vec {
  using R = __m256;
  static constexpr size_t kWidth = 8;
  static R Set1(float x) { return _mm256_set1_ps(x); }
  static R LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  static R LoadBF16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static R LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreF32(float* p, R x) { _mm256_storeu_ps(p, x); }
  // x's upper 16 bits after adding `addend` to its bits: rounded to nearest even (an addend of
  // 0x7fff plus the kept part's lowest bit) or stochastically (16 random bits). NaN stays NaN
  // (quiet): its rounded bits could carry into the exponent's neighbour.
  static void StoreBF16Adding(uint16_t* p, R x, __m256i addend) {
    const __m256i bits = _mm256_castps_si256(x);
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, addend), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void StoreBF16(uint16_t* p, R x) {
    const __m256i lsb =
        _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(1));
    StoreBF16Adding(p, x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  }
  static void StoreF16(uint16_t* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // bf16 state's stochastic rounding (kernels::RoundingBits and ToBF16Stochastic, 8 lanes).
  using I = __m256i;
  static I RoundingBits(uint32_t i, uint32_t seed) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i h = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), lanes);
    h = _mm256_add_epi32(_mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x9e3779b1u))),
                         _mm256_set1_epi32(static_cast<int>(seed)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x21f0aaad));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x735a2d97));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  }
  static I High16(I r) { return _mm256_srli_epi32(r, 16); }
  static void StoreBF16Stochastic(uint16_t* p, R x, I random) {
    StoreBF16Adding(p, x, _mm256_and_si256(random, _mm256_set1_epi32(0xffff)));
  }
  static R Sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R Mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R Div(R a, R b) { return _mm256_div_ps(a, b); }
  static R Fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R Sqrt(R a) { return _mm256_sqrt_ps(a); }
  static bool AnyNonFinite(R a) {
    const R diff = _mm256_sub_ps(a, a);  // 0 for finite lanes, NaN for inf and NaN
    return _mm256_movemask_ps(_mm256_cmp_ps(diff, _mm256_setzero_ps(), _CMP_NEQ_UQ)) != 0;
  }
};

}  // namespace
}  // namespace tierd::kernels

#define TIERD_ADAM_NS avx2
#include "kernels/adam_impl.h"
