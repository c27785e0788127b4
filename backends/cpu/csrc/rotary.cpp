// Rotary position embedding (the rotate-half form of Llama and its copies), applied in place to the query and key
// projections: transformers spends six torch ops per tensor on it (two multiplies, a negate, a concat, slices, an
// add), each a pass over memory. In float32 the arithmetic and its order are torch's, so the result is bit for bit
// the same; in bfloat16 it is computed in float32 and rounded once (torch rounds after each op).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace {

// x[d] * cos[d] - x[d + half] * sin[d] for the first half, x[d + half] * cos[d + half] + x[d] * sin[d + half] for
// the second: torch rounds each product before the sum, so no fused multiply-add may be formed here.
__attribute__((optimize("fp-contract=off"))) void rotate_heads(float* x, int64_t heads, int64_t dim,
                                                               const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* a = x + h * dim;
    float* b = a + half;
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = a[d], x2 = b[d];
      const float first_cos = x1 * cos[d];
      const float first_sin = x2 * sin[d];
      const float second_cos = x2 * cos[d + half];
      const float second_sin = x1 * sin[d + half];
      a[d] = first_cos - first_sin;
      b[d] = second_cos + second_sin;
    }
  }
}

template <typename trig_t>
void rotate_heads(at::BFloat16* x, int64_t heads, int64_t dim, const trig_t* cos, const trig_t* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    at::BFloat16* a = x + h * dim;
    at::BFloat16* b = a + half;
    int64_t d = 0;
#if defined(PAGEDLLM_VEC)
    using pagedllm::Vec;
    for (; d + Vec::size <= half; d += Vec::size) {
      const Vec x1 = Vec::load(a + d), x2 = Vec::load(b + d);
      (x1 * Vec::load(cos + d) - x2 * Vec::load(sin + d)).store(a + d);
      (x2 * Vec::load(cos + half + d) + x1 * Vec::load(sin + half + d)).store(b + d);
    }
#endif
    for (; d < half; ++d) {
      const float x1 = a[d], x2 = b[d];
      a[d] = static_cast<at::BFloat16>(x1 * static_cast<float>(cos[d]) - x2 * static_cast<float>(sin[d]));
      b[d] = static_cast<at::BFloat16>(x2 * static_cast<float>(cos[d + half]) + x1 * static_cast<float>(sin[d + half]));
    }
  }
}

void check_rows(const at::Tensor& x, int64_t head_size, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rotary_embedding: ", name, " must be float32 or bfloat16");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % head_size == 0 && x.stride(-1) == 1,
              "rotary_embedding: ", name, " must be [..., tokens, heads * head_size] with contiguous rows");
}

template <typename x_t, typename trig_t>
void rotate_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                int64_t head_size) {
  x_t* q_ptr = q.data_ptr<x_t>();
  x_t* k_ptr = k.data_ptr<x_t>();
  const trig_t* cos_ptr = cos.data_ptr<trig_t>();
  const trig_t* sin_ptr = sin.data_ptr<trig_t>();
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
  const int64_t q_heads = q.size(1) / head_size, k_heads = k.size(1) / head_size;
  at::parallel_for(0, q.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const trig_t* c = cos_ptr + t * head_size;
      const trig_t* s = sin_ptr + t * head_size;
      rotate_heads(q_ptr + t * q_stride, q_heads, head_size, c, s);
      rotate_heads(k_ptr + t * k_stride, k_heads, head_size, c, s);
    }
  });
}

}  // namespace

// query [..., tokens, q_heads * head_size], key [..., tokens, kv_heads * head_size] (rows evenly strided over the
// flattened leading dimensions), cos and sin [..., tokens, head_size] contiguous: both rotated in place. float32
// throughout, or bfloat16 query and key with bfloat16 or float32 cos and sin.
void rotary_embedding(at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin, int64_t head_size) {
  TORCH_CHECK(head_size > 0 && head_size % 2 == 0, "rotary_embedding: head_size must be even");
  check_rows(query, head_size, "query");
  check_rows(key, head_size, "key");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "rotary_embedding: query and key dtypes differ");
  const at::Tensor q = query.view({-1, query.size(-1)}), k = key.view({-1, key.size(-1)});
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_size && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == sin.scalar_type(),
              "rotary_embedding: cos and sin must be contiguous [..., tokens, head_size] of one dtype");
  TORCH_CHECK(k.size(0) == q.size(0) && cos.numel() == q.size(0) * head_size,
              "rotary_embedding: query, key, cos and sin must cover the same tokens");
  if (query.scalar_type() == at::kFloat) {
    TORCH_CHECK(cos.scalar_type() == at::kFloat, "rotary_embedding: float32 query needs float32 cos and sin");
    rotate_all<float, float>(q, k, cos, sin, head_size);
  } else if (cos.scalar_type() == at::kFloat) {
    rotate_all<at::BFloat16, float>(q, k, cos, sin, head_size);
  } else {
    rotate_all<at::BFloat16, at::BFloat16>(q, k, cos, sin, head_size);
  }
}
