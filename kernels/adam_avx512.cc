// The Adam kernel on AVX-512 (16 floats per register). Built with -mavx512f -mavx512bw
// -mavx512vl -mavx2 -mfma -mf16c; called only when the running CPU has them (cpu_adam.cc).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace tierd::kernels {
namespace {

struct Vec {
  using R = __m512;
  static constexpr size_t kWidth = 16;
  static R Set1(float x) { return _mm512_set1_ps(x); }
  static R LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  static R LoadBF16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static R LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void StoreF32(float* p, R x) { _mm512_storeu_ps(p, x); }
  // x's upper 16 bits after adding `addend` to its bits: rounded to nearest even (an addend of
  // 0x7fff plus the kept part's lowest bit) or stochastically (16 random bits). NaN stays NaN.
  static void StoreBF16Adding(uint16_t* p, R x, __m512i addend) {
    const __m512i bits = _mm512_castps_si512(x);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, addend), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static void StoreBF16(uint16_t* p, R x) {
    const __m512i lsb =
        _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(1));
    StoreBF16Adding(p, x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  }
  static void StoreF16(uint16_t* p, R x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  // bf16 state's stochastic rounding (kernels::RoundingBits and ToBF16Stochastic, 16 lanes).
  using I = __m512i;
  static I RoundingBits(uint32_t i, uint32_t seed) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i h = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), lanes);
    h = _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x9e3779b1u))),
                         _mm512_set1_epi32(static_cast<int>(seed)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x21f0aaad));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x735a2d97));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
  }
  static I High16(I r) { return _mm512_srli_epi32(r, 16); }
  static void StoreBF16Stochastic(uint16_t* p, R x, I random) {
    StoreBF16Adding(p, x, _mm512_and_si512(random, _mm512_set1_epi32(0xffff)));
  }
  static R Sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R Mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R Div(R a, R b) { return _mm512_div_ps(a, b); }
  static R Fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R Sqrt(R a) { return _mm512_sqrt_ps(a); }
  static bool AnyNonFinite(R a) {
    const R diff = _mm512_sub_ps(a, a);  // 0 for finite lanes, NaN for inf and NaN
    return _mm512_cmp_ps_mask(diff, _mm512_setzero_ps(), _CMP_NEQ_UQ) != 0;
  }
};

}  // namespace
}  // namespace tierd::kernels

#define TIERD_ADAM_NS avx512
#include "kernels/adam_impl.h"
