// The vector lanes of the kernels over block-quantized weights (quantized_weights.h) that need only AVX2 and FMA:
// AVX-512 covers a panel's 16 columns in one register, AVX2 in two halves of 8. Shared by the streaming kernels of
// quantized_linear.cpp and the float32 tiles of quantized_linear_f32.cpp.
#pragma once

#include "quantized_weights.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_QUANT_SIMD 1

namespace pagedllm {

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Lanes {
  static constexpr int halves = 1;
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr(I a, int bits) { return _mm512_srli_epi32(a, bits); }
  // right by `bits`, or left by -bits
  static I shift(I a, int bits) { return bits >= 0 ? _mm512_srli_epi32(a, bits) : _mm512_slli_epi32(a, -bits); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I shl4(I a) { return _mm512_slli_epi32(a, 4); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F loadh(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
  static F loadi8(const void* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
  }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // acc + per lane the sum of 4 products of unsigned bytes u (each below 64: vpmaddubsw's pair sums fit in int16)
  // and signed bytes a
  static I dot4(I acc, I u, I a) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, a);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, a), _mm512_set1_epi16(1)));
#endif
  }
  // acc + per lane the sum of 2 products of 16-bit halves (values u below 256, int16 activations a)
  static I dot2(I acc, I u, I a) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, u, a);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(u, a));
#endif
  }
  // the same for any unsigned bytes (vpmaddubsw would saturate: 16 * high nibbles + low nibbles)
  static I dot8(I acc, I u, I a) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, a);
#else
    const I mask = set1(0x0F0F0F0F);
    const I high = dot4(zeroi(), band(_mm512_srli_epi16(u, 4), mask), a);
    return addi(dot4(acc, band(u, mask), a), shl4(high));
#endif
  }
};
#else
struct Lanes {
  static constexpr int halves = 2;
  using I = __m256i;
  using F = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr(I a, int bits) { return _mm256_srli_epi32(a, bits); }
  static I shift(I a, int bits) { return bits >= 0 ? _mm256_srli_epi32(a, bits) : _mm256_slli_epi32(a, -bits); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I shl4(I a) { return _mm256_slli_epi32(a, 4); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F loadh(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static F loadi8(const void* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))));
  }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static I dot4(I acc, I u, I a) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
  }
  static I dot8(I acc, I u, I a) {
    const I mask = set1(0x0F0F0F0F);
    const I high = dot4(zeroi(), band(_mm256_srli_epi16(u, 4), mask), a);
    return addi(dot4(acc, band(u, mask), a), shl4(high));
  }
  static I dot2(I acc, I u, I a) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, u, a);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(u, a));
#endif
  }
};
#endif
constexpr int kLanes = kPanel / Lanes::halves;

// 5 and 6 bits: `low` (values below 16, in the fields that `mask` selects bits 4 and 5 of) with the high bit or 2 bits
// of nibble k of load j of the unit (lanes `high`) put above them (quantized_weights.h's high_bit).
inline Lanes::I with_high_bits(Lanes::I low, Lanes::I high, int bits, int j, int k, int32_t mask) {
  const int32_t field = bits == 5 ? mask & ~(mask << 1) : mask;  // bit 4 alone for 5 bits
  return Lanes::bor(low, Lanes::band(Lanes::shift(high, high_bit(bits, j, k) - 4), Lanes::set1(field)));
}

// Half h of the 16 scales or offsets of panel p, group g.
inline Lanes::F group_lanes(const QuantizedWeights& w, const void* table, int64_t p, int64_t g, int h) {
  const char* first = static_cast<const char*>(w.of_group(table, p, g));
  if (w.multipliers != nullptr)
    return Lanes::mul(Lanes::loadi8(first + h * kLanes), Lanes::loadf(w.multiplier_of(table, p, g) + h * kLanes));
  return w.half ? Lanes::loadh(first + h * kLanes * 2)
                : Lanes::loadf(reinterpret_cast<const float*>(first) + h * kLanes);
}

inline Lanes::F offset_lanes(const QuantizedWeights& w, Lanes::F scale, int64_t p, int64_t g, int h) {
  return w.zero > 0 ? Lanes::mul(scale, Lanes::set1f(static_cast<float>(-w.zero))) : group_lanes(w, w.offsets, p, g, h);
}

}  // namespace pagedllm

#else
#define PAGEDLLM_QUANT_SIMD 0
#endif
