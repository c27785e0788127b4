// Rotary position embedding (the rotate-half form of Llama and its copies), applied in place to the query and key
// projections: transformers spends six torch ops per tensor on it (two multiplies, a negate, a concat, slices, an
// add), each a pass over memory. Same arithmetic, in the same order, so the result is bit for bit torch's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

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

void check_rows(const at::Tensor& x, int64_t head_size, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary_embedding: ", name, " must be float32");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % head_size == 0 && x.stride(-1) == 1,
              "rotary_embedding: ", name, " must be [..., tokens, heads * head_size] with contiguous rows");
}

}  // namespace

// query [..., tokens, q_heads * head_size], key [..., tokens, kv_heads * head_size] (float32, rows evenly strided
// over the flattened leading dimensions), cos and sin [..., tokens, head_size] contiguous: both rotated in place.
void rotary_embedding(at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin, int64_t head_size) {
  TORCH_CHECK(head_size > 0 && head_size % 2 == 0, "rotary_embedding: head_size must be even");
  check_rows(query, head_size, "query");
  check_rows(key, head_size, "key");
  const at::Tensor q = query.view({-1, query.size(-1)}), k = key.view({-1, key.size(-1)});
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(-1) == head_size && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be contiguous float32 [..., tokens, head_size]");
  const int64_t tokens = q.size(0);
  TORCH_CHECK(k.size(0) == tokens && cos.numel() == tokens * head_size,
              "rotary_embedding: query, key, cos and sin must cover the same tokens");
  float* q_ptr = q.data_ptr<float>();
  float* k_ptr = k.data_ptr<float>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0);
  const int64_t q_heads = q.size(1) / head_size, k_heads = k.size(1) / head_size;
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + t * head_size;
      const float* s = sin_ptr + t * head_size;
      rotate_heads(q_ptr + t * q_stride, q_heads, head_size, c, s);
      rotate_heads(k_ptr + t * k_stride, k_heads, head_size, c, s);
    }
  });
}
