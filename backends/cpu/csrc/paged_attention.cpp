// Decode attention straight from the paged KV cache: no gather copy of the cached keys and values.
//
// One work item per (sequence, KV head): the query heads sharing that KV head (GQA group) are scored
// against every cached token in place, softmaxed, and used to sum the values. Caches are
// [num_blocks, kv_heads, block_size, head_size] in float32, bfloat16, or uint8 with a float32 scale
// and minimum per token and head (x = q * scale + minimum).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t bits) {
  uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

// Widen one cached row of `dim` elements to float32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim);

template <>
inline void load_row<float>(const float* src, float* dst, int64_t dim) {
  std::memcpy(dst, src, dim * sizeof(float));
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t dim) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = bf16_to_float(bits[d]);
}

template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]);
}

inline float dot(const float* a, const float* b, int64_t dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) y[d] += alpha * x[d];
}

template <typename scalar_t, typename cache_t>
void decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const c10::optional<torch::Tensor>& key_scale,
            const c10::optional<torch::Tensor>& key_min, const c10::optional<torch::Tensor>& value_scale,
            const c10::optional<torch::Tensor>& value_min, const torch::Tensor& block_table,
            const torch::Tensor& seq_lens, double scale, int64_t window) {
  const int64_t num_seqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t groups = num_heads / kv_heads;
  const int64_t table_width = block_table.size(1);
  constexpr bool quantized = std::is_same<cache_t, uint8_t>::value;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  const float* ks_ptr = quantized ? key_scale->data_ptr<float>() : nullptr;
  const float* km_ptr = quantized ? key_min->data_ptr<float>() : nullptr;
  const float* vs_ptr = quantized ? value_scale->data_ptr<float>() : nullptr;
  const float* vm_ptr = quantized ? value_min->data_ptr<float>() : nullptr;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(groups * dim), q_sum(groups), row(dim), acc(groups * dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - first;
      for (int64_t g = 0; g < groups; ++g) {
        const scalar_t* src = q_ptr + seq * q_seq_stride + (head * groups + g) * q_head_stride;
        float total = 0.f;
        for (int64_t d = 0; d < dim; ++d) {
          q[g * dim + d] = static_cast<float>(src[d]) * static_cast<float>(scale);
          total += q[g * dim + d];
        }
        q_sum[g] = total;
      }
      scores.assign(groups * span, 0.f);
      for (int64_t t = first; t < len; ++t) {
        const int64_t block = table[seq * table_width + t / block_size];
        const int64_t slot = (block * kv_heads + head) * block_size + t % block_size;
        load_row<cache_t>(k_ptr + slot * dim, row.data(), dim);
        for (int64_t g = 0; g < groups; ++g) {
          float s = dot(q.data() + g * dim, row.data(), dim);
          if (quantized) s = s * ks_ptr[slot] + km_ptr[slot] * q_sum[g];
          scores[g * span + (t - first)] = s;
        }
      }
      std::vector<float> inv_sum(groups);
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * span;
        const float peak = *std::max_element(s, s + span);
        float total = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - peak);
          total += s[i];
        }
        inv_sum[g] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const int64_t block = table[seq * table_width + t / block_size];
        const int64_t slot = (block * kv_heads + head) * block_size + t % block_size;
        load_row<cache_t>(v_ptr + slot * dim, row.data(), dim);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * span + (t - first)];
          if (quantized) {
            const float ps = p * vs_ptr[slot], pm = p * vm_ptr[slot];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += ps * row[d] + pm;
          } else {
            axpy(p, row.data(), acc.data() + g * dim, dim);
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        scalar_t* dst = out_ptr + (seq * num_heads + head * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv_sum[g]);
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                    const torch::Tensor& value_cache, const c10::optional<torch::Tensor>& key_scale,
                    const c10::optional<torch::Tensor>& key_min, const c10::optional<torch::Tensor>& value_scale,
                    const c10::optional<torch::Tensor>& value_min, const torch::Tensor& block_table,
                    const torch::Tensor& seq_lens, double scale, int64_t window) {
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode<scalar_t, float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                              block_table, seq_lens, scale, window);
      break;
    case at::kBFloat16:
      decode<scalar_t, at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale,
                                     value_min, block_table, seq_lens, scale, window);
      break;
    case at::kByte:
      decode<scalar_t, uint8_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                block_table, seq_lens, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported cache dtype ", key_cache.scalar_type());
  }
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size]; block_table: int64 [num_seqs, width]; seq_lens: int64 [num_seqs].
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, c10::optional<torch::Tensor> key_scale,
                            c10::optional<torch::Tensor> key_min, c10::optional<torch::Tensor> value_scale,
                            c10::optional<torch::Tensor> value_min, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous(), "query rows and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table and seq_lens must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                            block_table, seq_lens, scale, window);
      break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                   block_table, seq_lens, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported query dtype ", query.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
}
