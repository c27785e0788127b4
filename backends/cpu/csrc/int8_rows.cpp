// The two passes around oneDNN's int8 GEMM for W8A8 linears (layers/int8_gemm.py): activations quantized to int8
// per row (symmetric, d = max |x| / 127, as vLLM CPU's dynamic per-token scales), and the GEMM's output scaled back
// per row with the bias added. In torch each is several passes over the rows, as long as the GEMM itself.
// The int8 values are stored offset by 128 as uint8 (zero point 128): oneDNN's VNNI kernels multiply unsigned by
// signed bytes only, and take signed activations to its scalar reference kernel.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "vec.h"

namespace {

// q = round-half-even(x * inverse) + 128 (|x * inverse| <= 127 by the choice of the scale): the int8 value's bits
// with the sign bit flipped.
template <typename T>
void quantize_row(const T* x, int64_t k, float inverse, uint8_t* q) {
  int64_t i = 0;
#if defined(PAGEDLLM_VEC)
  using pagedllm::Vec;
  const Vec factor = Vec::broadcast(inverse);
  for (; i + Vec::size <= k; i += Vec::size) {
    const Vec v = Vec::load(x + i) * factor;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v.v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(bytes, _mm_set1_epi8(-128)));
#else
    const __m256i whole = _mm256_cvtps_epi32(v.v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
    const __m128i bytes = _mm_packs_epi16(words, words);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(bytes, _mm_set1_epi8(-128)));
#endif
  }
#endif
  for (; i < k; ++i) q[i] = static_cast<uint8_t>(std::nearbyint(static_cast<float>(x[i]) * inverse) + 128.f);
}

template <typename T>
float row_amax(const T* x, int64_t k) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(PAGEDLLM_VEC)
  using pagedllm::Vec;
  Vec acc = Vec::zero();
  for (; i + Vec::size <= k; i += Vec::size) {
    const Vec v = Vec::load(x + i);
    acc = Vec::max(acc, Vec::max(v, Vec::zero() - v));
  }
  amax = acc.max();
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  return amax;
}

template <typename T>
void scale_row(T* out, int64_t n, float scale, const float* bias) {
  int64_t i = 0;
#if defined(PAGEDLLM_VEC)
  using pagedllm::Vec;
  const Vec factor = Vec::broadcast(scale);
  for (; i + Vec::size <= n; i += Vec::size) {
    const Vec v = Vec::load(out + i) * factor;
    (bias ? v + Vec::load(bias + i) : v).store(out + i);
  }
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(static_cast<float>(out[i]) * scale + (bias ? bias[i] : 0.f));
}

// run(pointer to the tensor's elements) for a float32 or bf16 tensor.
template <typename Run>
void with_float_or_bf16(const at::Tensor& t, const char* name, const Run& run) {
  if (t.scalar_type() == at::kFloat) {
    run(t.data_ptr<float>());
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16 rows, not ", t.scalar_type());
    run(t.data_ptr<at::BFloat16>());
  }
}

}  // namespace

// x [..., k] (bf16 or float32) -> (uint8 [rows, k], float32 scales [rows, 1]) with x ~ scale * (q - 128) per row.
std::tuple<at::Tensor, at::Tensor> quantize_rows_uint8(const at::Tensor& x) {
  const at::Tensor rows = x.contiguous();
  const int64_t k = rows.size(-1), m = rows.numel() / k;
  at::Tensor q = at::empty({m, k}, rows.options().dtype(at::kByte));
  at::Tensor scales = at::empty({m, 1}, rows.options().dtype(at::kFloat));
  uint8_t* q_data = q.data_ptr<uint8_t>();
  float* scale_data = scales.data_ptr<float>();
  with_float_or_bf16(rows, "quantize_rows_uint8", [&](auto* data) {
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float d = row_amax(data + r * k, k) / 127.f;
        scale_data[r] = d;
        quantize_row(data + r * k, k, d > 0.f ? 1.f / d : 0.f, q_data + r * k);
      }
    });
  });
  return {q, scales};
}

// out[r, :] = out[r, :] * scales[r] + bias, in place (out bf16 or float32 [rows, n], contiguous).
void scale_rows(at::Tensor& out, const at::Tensor& scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(out.is_contiguous(), "scale_rows: out must be contiguous");
  const int64_t n = out.size(-1), m = out.numel() / n;
  const float* scale_data = scales.data_ptr<float>();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bias_data = b.defined() ? b.data_ptr<float>() : nullptr;
  with_float_or_bf16(out, "scale_rows", [&](auto* data) {
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) scale_row(data + r * n, n, scale_data[r], bias_data);
    });
  });
}
