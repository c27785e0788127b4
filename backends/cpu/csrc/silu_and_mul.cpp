// SwiGLU's silu(gate) * up in one pass: torch runs it as silu, then a multiply, each a full pass over
// [tokens, width].
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fast_exp.h"
#include "vec.h"

namespace {

// silu(x) = x / (1 + exp(-x)), from e = exp(-|x|) <= 1 so that exp never overflows: x / (1 + e) for x >= 0,
// x * e / (1 + e) below.
inline float silu(float x) {
  const float e = pagedllm::exp_nonpositive(-std::fabs(x));
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {  // round to nearest even
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
}

// silu on eight lanes, the same steps as the scalar one (the scalar loop does not vectorize).
inline __m256 silu8(__m256 x) {
  const __m256 e = pagedllm::exp_nonpositive8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  // exp(-|x|)
  const __m256 non_negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 numerator = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, non_negative);
  return _mm256_div_ps(numerator, _mm256_add_ps(_mm256_set1_ps(1.f), e));
}
#endif

// scales (or none): a factor per row applied to gate and up first (a W8A8 GEMM's per-row activation scale).
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* gates, int64_t gate_stride, const scalar_t* ups, int64_t up_stride,
                       scalar_t* out, int64_t rows, int64_t width, const float* scales) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = gates + r * gate_stride;
      const scalar_t* up = ups + r * up_stride;
      scalar_t* o = out + r * width;
      const float s = scales ? scales[r] : 1.f;  // x * 1 is x: no scales computes exactly as before
      int64_t i = 0;
#if defined(__AVX512F__) && defined(PAGEDLLM_VEC)
      if constexpr (!std::is_same<scalar_t, double>::value) {
        const pagedllm::Vec factor = pagedllm::Vec::broadcast(s);
        for (; i + 16 <= width; i += 16)
          (pagedllm::silu16(pagedllm::Vec::load(gate + i) * factor) * (pagedllm::Vec::load(up + i) * factor))
              .store(o + i);
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (!std::is_same<scalar_t, double>::value) {
        const __m256 factor = _mm256_set1_ps(s);
        for (; i + 8 <= width; i += 8)  // bf16 computed in float32, rounded once
          store8(o + i, _mm256_mul_ps(silu8(_mm256_mul_ps(load8(gate + i), factor)),
                                      _mm256_mul_ps(load8(up + i), factor)));
      }
#endif
      for (; i < width; ++i)
        o[i] = static_cast<scalar_t>(silu(static_cast<float>(gate[i]) * s) * (static_cast<float>(up[i]) * s));
    }
  });
}

}  // namespace

// gate and up: [..., width] each, rows evenly strided with contiguous elements (two halves of one projection's
// output, or two outputs); scales: float32, one per row, multiplying both first.
at::Tensor silu_and_mul(at::Tensor gate, at::Tensor up, c10::optional<at::Tensor> scales) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type() && gate.dim() >= 1,
              "silu_and_mul: gate and up of one shape and dtype");
  const int64_t width = gate.size(-1);
  at::Tensor out = gate.new_empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const at::Tensor g = gate.reshape({-1, width}), u = up.reshape({-1, width});
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1, "silu_and_mul: elements of a row must be contiguous");
  const at::Tensor row_scales = scales.has_value() ? scales->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!row_scales.defined() || row_scales.numel() == g.size(0), "silu_and_mul: one scale per row");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows(g.data_ptr<scalar_t>(), g.stride(0), u.data_ptr<scalar_t>(), u.stride(0),
                      out.data_ptr<scalar_t>(), g.size(0), width,
                      row_scales.defined() ? row_scales.data_ptr<float>() : nullptr);
  });
  return out;
}
