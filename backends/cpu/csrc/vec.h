// One float vector type per ISA level, so a kernel is written once for AVX-512 (16 lanes) and AVX2 (8 lanes):
// loads widen float, bfloat16 and uint8 elements to float32 in registers, and stores round back.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "fast_exp.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLLM_VEC 1
struct Vec {
  static constexpr int64_t size = 16;
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {  // bf16 is the top half of a float32: widen by shifting
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
  }
  static Vec load(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(at::BFloat16* p) const {  // round to nearest even, as torch's conversion does (NaN aside)
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
  Vec rounded_to_bf16() const {  // the value a bf16 store and load would give
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return {_mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  Vec operator+(Vec o) const { return {_mm512_add_ps(v, o.v)}; }
  Vec operator-(Vec o) const { return {_mm512_sub_ps(v, o.v)}; }
  Vec operator*(Vec o) const { return {_mm512_mul_ps(v, o.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  // exp(x) for x <= 0: exp_nonpositive's steps on sixteen lanes.
  static Vec exp_nonpositive(Vec x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x.v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, whole);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return {_mm512_mul_ps(p, _mm512_castsi512_ps(bits))};
  }
};
// silu(x) = x / (1 + exp(-x)) on sixteen lanes, from e = exp(-|x|) <= 1 so that exp never overflows: x / (1 + e)
// for x >= 0, x * e / (1 + e) below.
inline Vec silu16(Vec x) {
  const __m512 negative_abs =
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 e = Vec::exp_nonpositive({negative_abs}).v;
  const __mmask16 non_negative = _mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 numerator = _mm512_mask_blend_ps(non_negative, _mm512_mul_ps(x.v, e), x.v);
  return {_mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.f), e))};
}
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_VEC 1
struct Vec {
  static constexpr int64_t size = 8;
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))};
  }
  static Vec load(const uint8_t* p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(at::BFloat16* p) const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  Vec rounded_to_bf16() const {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return {_mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  float max() const {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  Vec operator+(Vec o) const { return {_mm256_add_ps(v, o.v)}; }
  Vec operator-(Vec o) const { return {_mm256_sub_ps(v, o.v)}; }
  Vec operator*(Vec o) const { return {_mm256_mul_ps(v, o.v)}; }
  static Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec exp_nonpositive(Vec x) { return {exp_nonpositive8(x.v)}; }
};
#endif

}  // namespace pagedllm
