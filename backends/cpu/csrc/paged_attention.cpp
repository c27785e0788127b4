// Decode attention straight from the paged KV cache: no gather copy of the cached keys and values.
//
// One work item per (sequence, KV head): the query heads sharing that KV head (GQA group) are scored
// against every cached token in place, softmaxed, and used to sum the values. Caches are
// [num_blocks, kv_heads, block_size, head_size] in float32, bfloat16, or uint8 with a float32 scale
// and minimum per token and head (x = q * scale + minimum).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// A block's rows [0, rows) as float32 [rows, dim]: float caches are read in place; bf16 is widened and u8
// dequantized (x = q * scale + minimum, per row) into `scratch`.
template <typename T>
inline const float* block_as_float(const T* block, const float* scale, const float* minimum, int64_t rows,
                                   int64_t dim, float* scratch);

template <>
inline const float* block_as_float<float>(const float* block, const float*, const float*, int64_t, int64_t,
                                          float*) {
  return block;
}

template <>
inline const float* block_as_float<at::BFloat16>(const at::BFloat16* block, const float*, const float*,
                                                 int64_t rows, int64_t dim, float* scratch) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(block);
#pragma omp simd
  for (int64_t i = 0; i < rows * dim; ++i) scratch[i] = bf16_to_float(bits[i]);
  return scratch;
}

template <>
inline const float* block_as_float<uint8_t>(const uint8_t* block, const float* scale, const float* minimum,
                                            int64_t rows, int64_t dim, float* scratch) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale[r], m = minimum[r];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) scratch[r * dim + d] = static_cast<float>(block[r * dim + d]) * s + m;
  }
  return scratch;
}

inline float dot(const float* a, const float* b, int64_t dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += a[d] * b[d];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight sums of eight lanes each, as one vector: [sum(a0), ..., sum(a7)].
inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

// Ask for a block's bytes ahead of use: blocks sit at scattered addresses, which the hardware prefetcher
// cannot guess, so without this every block starts with a run of cache misses.
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// scores[g * stride + r] = q_g . keys_r for the group's query heads against `rows` keys.
inline void block_scores(const float* q, int64_t groups, const float* keys, int64_t rows, int64_t dim,
                         float* scores, int64_t stride) {
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {
    for (; r + 8 <= rows; r += 8) {
      const float* k = keys + r * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = q + g * dim;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < dim; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 0 * dim + d), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 1 * dim + d), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * dim + d), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * dim + d), a3);
          a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * dim + d), a4);
          a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * dim + d), a5);
          a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * dim + d), a6);
          a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * dim + d), a7);
        }
        _mm256_storeu_ps(scores + g * stride + r, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
      }
    }
  }
#endif
  for (; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) scores[g * stride + r] = dot(q + g * dim, keys + r * dim, dim);
}

// acc[g] += sum_r probs[g * stride + r] * values_r for the group's query heads.
inline void block_accumulate(const float* probs, int64_t stride, int64_t groups, const float* values,
                             int64_t rows, int64_t dim, float* acc) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 64 == 0) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t d = 0; d < dim; d += 64) {
        float* a = acc + g * dim + d;
        __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16),
               a3 = _mm256_loadu_ps(a + 24), a4 = _mm256_loadu_ps(a + 32), a5 = _mm256_loadu_ps(a + 40),
               a6 = _mm256_loadu_ps(a + 48), a7 = _mm256_loadu_ps(a + 56);
        for (int64_t r = 0; r < rows; ++r) {
          const __m256 p = _mm256_set1_ps(probs[g * stride + r]);
          const float* v = values + r * dim + d;
          a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
          a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
          a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
          a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
          a4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), a4);
          a5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), a5);
          a6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), a6);
          a7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), a7);
        }
        _mm256_storeu_ps(a, a0);
        _mm256_storeu_ps(a + 8, a1);
        _mm256_storeu_ps(a + 16, a2);
        _mm256_storeu_ps(a + 24, a3);
        _mm256_storeu_ps(a + 32, a4);
        _mm256_storeu_ps(a + 40, a5);
        _mm256_storeu_ps(a + 48, a6);
        _mm256_storeu_ps(a + 56, a7);
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float p = probs[g * stride + r];
      float* a = acc + g * dim;
      const float* v = values + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
    }
}

// exp(x) for x <= 0 in plain arithmetic, so the softmax loop vectorizes (glibc's expf does not here):
// 2^t = 2^round(t) * 2^f with |f| <= 1/2 and Cephes' exp2f polynomial; relative error about 2e-7.
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float whole = std::nearbyint(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof(power));
  return p * power;
}

// In place: s[i] = exp(s[i] - max(s)); returns 1 / sum.
inline float softmax_numerators(float* s, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) peak = std::max(peak, s[i]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - peak);
    total += s[i];
  }
  return 1.f / total;
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
    std::vector<float> q(groups * dim), scratch(block_size * dim), acc(groups * dim), scores, inv_sum(groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* blocks = table + seq * table_width;
      for (int64_t g = 0; g < groups; ++g) {
        const scalar_t* src = q_ptr + seq * q_seq_stride + (head * groups + g) * q_head_stride;
        for (int64_t d = 0; d < dim; ++d) q[g * dim + d] = static_cast<float>(src[d]) * static_cast<float>(scale);
      }
      // Scores are laid out per block-aligned position from the first block, so blocks never straddle rows.
      const int64_t first_block = first / block_size, end_block = (len + block_size - 1) / block_size;
      const int64_t origin = first_block * block_size, span = end_block * block_size - origin;
      scores.resize(groups * span);
      // Pass 1: scores of every query head of the group against every cached key, block by block.
      const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(cache_t));
      for (int64_t b = first_block; b < end_block; ++b) {
        const int64_t slot = (blocks[b] * kv_heads + head) * block_size;  // the block's first slot
        const int64_t rows = std::min(len, (b + 1) * block_size) - b * block_size;
        if (b + 1 < end_block) prefetch_block(k_ptr + (blocks[b + 1] * kv_heads + head) * block_size * dim, block_bytes);
        const float* keys = block_as_float<cache_t>(k_ptr + slot * dim, quantized ? ks_ptr + slot : nullptr,
                                                    quantized ? km_ptr + slot : nullptr, rows, dim, scratch.data());
        block_scores(q.data(), groups, keys, rows, dim, scores.data() + (b * block_size - origin), span);
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * span;
        const int64_t lo = first - origin, hi = len - origin;  // the keys this query may see
        inv_sum[g] = softmax_numerators(s + lo, hi - lo);
        std::fill(s, s + lo, 0.f);
        std::fill(s + hi, s + span, 0.f);
      }
      // Pass 2: the probability-weighted sum of the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = first_block; b < end_block; ++b) {
        const int64_t slot = (blocks[b] * kv_heads + head) * block_size;
        const int64_t rows = std::min(len, (b + 1) * block_size) - b * block_size;
        if (b + 1 < end_block) prefetch_block(v_ptr + (blocks[b + 1] * kv_heads + head) * block_size * dim, block_bytes);
        const float* values = block_as_float<cache_t>(v_ptr + slot * dim, quantized ? vs_ptr + slot : nullptr,
                                                      quantized ? vm_ptr + slot : nullptr, rows, dim,
                                                      scratch.data());
        block_accumulate(scores.data() + (b * block_size - origin), span, groups, values, rows, dim, acc.data());
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

// Pin the OpenMP threads of the calling thread's team one to a CPU: thread i of every later parallel region
// started from this thread runs on cpus[i] (libgomp reuses its pool threads in order).
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<int64_t> placed(n, -1);
  omp_set_num_threads(n);
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[i]), &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) placed[i] = sched_getcpu();
  }
  return placed;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
  m.def("bind_threads", &bind_threads, "pin the calling thread's OpenMP threads, one per CPU");
}
