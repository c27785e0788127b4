// Attention straight from the paged KV cache, for decodes and for prompt chunks: no gather copy of the cached keys
// and values.
//
// Decodes: one work item per (sequence, KV head): the query heads sharing that KV head (GQA group) are scored
// against every cached token in place, softmaxed, and used to sum the values. Blocks that all the decodes' tables
// begin with (a prompt prefix shared through the prefix cache) are attended first, once per tile of sequences
// (bf16: as tile GEMMs through brgemm). Each pass over a sequence's blocks asks for the blocks of the pass after it
// (its values, then the next item's keys) into L2, so memory reads overlap with arithmetic.
// Prompt chunks: the same per tile of query tokens (see prefill below). Caches are
// [num_blocks, kv_heads, block_size, head_size] in float32, bfloat16, or uint8 with a float32 scale
// and minimum per token and head (x = q * scale + minimum).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "vec.h"

namespace {

using pagedllm::exp_nonpositive;
#if defined(__AVX2__) && defined(__FMA__)
using pagedllm::exp_nonpositive8;
#endif

// Scratch memory that the caller fills: a std::vector would first write every bf16 element one by one.
template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::make_unique_for_overwrite<T[]>(n);
}

// A cache element as float32; u8 rows are dequantized by the caller (x = q * scale + minimum per row).
inline float as_float(float x) { return x; }
inline float as_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float as_float(uint8_t x) { return static_cast<float>(x); }

#if defined(__AVX2__) && defined(__FMA__)
// Eight sums of eight lanes each, as one vector: [sum(a0), ..., sum(a7)].
inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

#if defined(PAGEDLLM_VEC)
using pagedllm::Vec;

// The lanes of eight vectors summed, in order: out[i] = sum(acc[i]).
inline void sum8(const Vec* acc, float* out) {
#if defined(__AVX512F__)
  __m256 half[8];
  for (int i = 0; i < 8; ++i)
    half[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i].v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i].v), 1)));
  _mm256_storeu_ps(out, sum8x8(half[0], half[1], half[2], half[3], half[4], half[5], half[6], half[7]));
#else
  _mm256_storeu_ps(out, sum8x8(acc[0].v, acc[1].v, acc[2].v, acc[3].v, acc[4].v, acc[5].v, acc[6].v, acc[7].v));
#endif
}
#endif

// Ask for a block's bytes ahead of use: blocks sit at scattered addresses, which the hardware prefetcher
// cannot guess, so without this every block starts with a run of cache misses. Locality 3 asks for L1, 1 for the
// outer levels (a block wanted a pass later).
template <int locality = 3>
inline void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, locality);
}

// scores[g * stride + r] = q_g . key_r for the group's query heads against a block's `rows` keys, read in place
// (bf16 and u8 widened in registers). u8 keys are q8 * scale + minimum per row, so q . key = scale * (q . q8) +
// minimum * sum(q): `q_sums` holds sum(q_g).
template <typename cache_t>
inline void block_scores(const float* q, const float* q_sums, int64_t groups, const cache_t* keys, const float* scale,
                         const float* minimum, int64_t rows, int64_t dim, float* scores, int64_t stride) {
  constexpr bool quantized = std::is_same<cache_t, uint8_t>::value;
  int64_t r = 0;
#if defined(PAGEDLLM_VEC)
  if (dim % Vec::size == 0) {
    for (; r + 8 <= rows; r += 8) {
      const cache_t* k = keys + r * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = q + g * dim;
        Vec acc[8] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero(),
                      Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
        for (int64_t d = 0; d < dim; d += Vec::size) {
          const Vec qv = Vec::load(qg + d);
          for (int i = 0; i < 8; ++i) acc[i] = Vec::fma(qv, Vec::load(k + i * dim + d), acc[i]);
        }
        float* s = scores + g * stride + r;
        sum8(acc, s);
        if constexpr (quantized)
          for (int i = 0; i < 8; ++i) s[i] = s[i] * scale[r + i] + minimum[r + i] * q_sums[g];
      }
    }
  }
#endif
  for (; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = q + g * dim;
      const cache_t* k = keys + r * dim;
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) sum += qg[d] * as_float(k[d]);
      scores[g * stride + r] = quantized ? sum * scale[r] + minimum[r] * q_sums[g] : sum;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGEDLLM_DPBF16 1
// scores[g * stride + r] = scale * (q_g . key_r) for bf16 queries against a bf16 block, with AVX512_BF16's pairwise
// dot products (exact products, float32 sums): no widening at all. dim % 32 == 0.
inline void block_scores_bf16(const at::BFloat16* q, int64_t groups, const at::BFloat16* keys, int64_t rows,
                              int64_t dim, float scale, float* scores, int64_t stride) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) {
    const at::BFloat16* k = keys + r * dim;
    for (int64_t g = 0; g < groups; ++g) {
      Vec acc[8] = {Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero(),
                    Vec::zero(), Vec::zero(), Vec::zero(), Vec::zero()};
      for (int64_t d = 0; d < dim; d += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + g * dim + d);
        for (int i = 0; i < 8; ++i)
          acc[i].v = _mm512_dpbf16_ps(acc[i].v, qv, (__m512bh)_mm512_loadu_si512(k + i * dim + d));
      }
      float* s = scores + g * stride + r;
      sum8(acc, s);
      for (int i = 0; i < 8; ++i) s[i] *= scale;
    }
  }
  for (; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + g * dim + d),
                               (__m512bh)_mm512_loadu_si512(keys + r * dim + d));
      scores[g * stride + r] = _mm512_reduce_add_ps(acc) * scale;
    }
}
#else
#define PAGEDLLM_DPBF16 0
#endif

// A tile's query rows, ready for the score pass: float32 scaled by the softmax scale; and for bf16 queries against a
// bf16 cache where the CPU has AVX512_BF16, the bf16 rows themselves, which the pairwise dot products take.
template <typename scalar_t, typename cache_t>
struct QueryRows {
  static constexpr bool kBf16 = std::is_same<scalar_t, at::BFloat16>::value &&
                                std::is_same<cache_t, at::BFloat16>::value && PAGEDLLM_DPBF16;
  const int64_t dim;
  const float scale;
  const bool pairwise;
  std::vector<float> scaled, sums;
  std::vector<at::BFloat16> raw;

  QueryRows(int64_t max_rows, int64_t dim, double scale)
      : dim(dim), scale(static_cast<float>(scale)), pairwise(kBf16 && dim % 32 == 0), sums(max_rows) {
    if (pairwise)
      raw.resize(max_rows * dim);
    else
      scaled.resize(max_rows * dim);
  }

  void set(int64_t row, const scalar_t* src) {
    if (pairwise) {
      std::copy(src, src + dim, reinterpret_cast<scalar_t*>(raw.data()) + row * dim);
    } else {
      for (int64_t d = 0; d < dim; ++d) scaled[row * dim + d] = static_cast<float>(src[d]) * scale;
    }
  }
};

#if defined(PAGEDLLM_VEC)
// Vectors of one head's accumulator held in registers at a time (AVX-512: 4 x 16 floats, AVX2: 2 x 8), for a
// compile-time number of heads: a run-time head count would keep the accumulators on the stack, every FMA waiting
// on a store and a load.
#if defined(__AVX512F__)
constexpr int kDimVecs = 4;
#else
constexpr int kDimVecs = 2;
#endif

// acc[j][d0, d0 + kDimVecs * Vec::size) += sum_r weight[j * stride + r] * values_r[same] for `heads` = HT heads.
template <int HT, typename cache_t>
inline void accumulate_tile(const float* weight, int64_t stride, const cache_t* values, int64_t rows, int64_t dim,
                            int64_t d0, float* acc) {
  Vec a[HT][kDimVecs];
#pragma GCC unroll 8
  for (int j = 0; j < HT; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < kDimVecs; ++i) a[j][i] = Vec::load(acc + j * dim + d0 + i * Vec::size);
  for (int64_t r = 0; r < rows; ++r) {
    Vec v[kDimVecs];
#pragma GCC unroll 8
    for (int i = 0; i < kDimVecs; ++i) v[i] = Vec::load(values + r * dim + d0 + i * Vec::size);
#pragma GCC unroll 8
    for (int j = 0; j < HT; ++j) {
      const Vec w = Vec::broadcast(weight[j * stride + r]);
#pragma GCC unroll 8
      for (int i = 0; i < kDimVecs; ++i) a[j][i] = Vec::fma(w, v[i], a[j][i]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < HT; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < kDimVecs; ++i) a[j][i].store(acc + j * dim + d0 + i * Vec::size);
}
#endif

// acc[g] += sum_r probs[g * stride + r] * values_r for the group's query heads over a block's `rows` values, read in
// place. u8 values: sum_r p_r * (q8_r * scale_r + minimum_r) = sum_r (p_r * scale_r) * q8_r + sum_r p_r * minimum_r.
template <typename cache_t>
inline void block_accumulate(const float* probs, int64_t stride, int64_t groups, const cache_t* values,
                             const float* scale, const float* minimum, int64_t rows, int64_t dim, float* acc) {
  constexpr bool quantized = std::is_same<cache_t, uint8_t>::value;
  constexpr int64_t kGroupTile = 4;  // heads per pass over the block (accumulate_tile's cases below)
  float scaled[kGroupTile * 1024];  // u8: probs times the row scales of up to kGroupTile heads (blocks <= 1024 rows)
  for (int64_t g0 = 0; g0 < groups; g0 += kGroupTile) {
    const int64_t heads = std::min(kGroupTile, groups - g0);
    const float* weight = probs + g0 * stride;
    int64_t weight_stride = stride;
    if constexpr (quantized) {
      for (int64_t j = 0; j < heads; ++j) {
        const float* p = probs + (g0 + j) * stride;
        float offset = 0.f;
        for (int64_t r = 0; r < rows; ++r) {
          scaled[j * rows + r] = p[r] * scale[r];
          offset += p[r] * minimum[r];
        }
        for (int64_t d = 0; d < dim; ++d) acc[(g0 + j) * dim + d] += offset;
      }
      weight = scaled;
      weight_stride = rows;
    }
#if defined(PAGEDLLM_VEC)
    if (dim % (kDimVecs * Vec::size) == 0) {
      float* a = acc + g0 * dim;
      for (int64_t d0 = 0; d0 < dim; d0 += kDimVecs * Vec::size) {
        switch (heads) {
          case 1: accumulate_tile<1>(weight, weight_stride, values, rows, dim, d0, a); break;
          case 2: accumulate_tile<2>(weight, weight_stride, values, rows, dim, d0, a); break;
          case 3: accumulate_tile<3>(weight, weight_stride, values, rows, dim, d0, a); break;
          default: accumulate_tile<4>(weight, weight_stride, values, rows, dim, d0, a); break;
        }
      }
      continue;
    }
#endif
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t j = 0; j < heads; ++j) {
        float sum = acc[(g0 + j) * dim + d];
        for (int64_t r = 0; r < rows; ++r) sum += weight[j * weight_stride + r] * as_float(values[r * dim + d]);
        acc[(g0 + j) * dim + d] = sum;
      }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float horizontal_sum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// In place: s[i] = exp(s[i] - max(s)); returns 1 / sum (and the max in *peak_out when asked).
inline float softmax_numerators(float* s, int64_t n, float* peak_out = nullptr) {
  float peak = -std::numeric_limits<float>::infinity();
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 peak8 = _mm256_set1_ps(peak);
  for (; i + 8 <= n; i += 8) peak8 = _mm256_max_ps(peak8, _mm256_loadu_ps(s + i));
  peak = horizontal_max(peak8);
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  const __m256 shift = _mm256_set1_ps(peak);
  __m256 sums = _mm256_setzero_ps();  // eight running sums: one chain of scalar adds waits on each add in turn
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + i), shift));
    _mm256_storeu_ps(s + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  total = horizontal_sum(sums);
#else
  for (; i < n; ++i) peak = std::max(peak, s[i]);
  i = 0;
#endif
  for (; i < n; ++i) {
    s[i] = exp_nonpositive(s[i] - peak);
    total += s[i];
  }
  if (peak_out != nullptr) *peak_out = peak;
  return 1.f / total;
}

// dst[0, dim) = src converted to the cache's type (float or bfloat16; u8 caches are written by the caller).
template <typename cache_t, typename scalar_t>
inline void store_row(cache_t* dst, const scalar_t* src, int64_t dim) {
  if constexpr (std::is_same<cache_t, uint8_t>::value) {
    TORCH_CHECK(false, "paged decode attention: u8 caches are written before the call");
  } else {
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<cache_t>(static_cast<float>(src[d]));
  }
}

// The layer's paged keys and values, read in place: the two passes over one (sequence, KV head) that decodes and
// prompt chunks share.
template <typename cache_t>
struct PagedCache {
  static constexpr bool quantized = std::is_same<cache_t, uint8_t>::value;
  const cache_t *keys, *values;
  const float *key_scale, *key_min, *value_scale, *value_min;  // u8 caches only
  const int64_t* table;
  int64_t table_width, kv_heads, block_size, dim;

  PagedCache(const at::Tensor& key_cache, const at::Tensor& value_cache, const c10::optional<at::Tensor>& k_scale,
             const c10::optional<at::Tensor>& k_min, const c10::optional<at::Tensor>& v_scale,
             const c10::optional<at::Tensor>& v_min, const at::Tensor& block_table)
      : keys(key_cache.data_ptr<cache_t>()), values(value_cache.data_ptr<cache_t>()),
        key_scale(quantized ? k_scale->data_ptr<float>() : nullptr),
        key_min(quantized ? k_min->data_ptr<float>() : nullptr),
        value_scale(quantized ? v_scale->data_ptr<float>() : nullptr),
        value_min(quantized ? v_min->data_ptr<float>() : nullptr), table(block_table.data_ptr<int64_t>()),
        table_width(block_table.size(1)), kv_heads(key_cache.size(1)), block_size(key_cache.size(2)),
        dim(key_cache.size(3)) {}

  // A later pass over one sequence's blocks of one cache: its blocks are asked for into L2 during the current
  // pass, one per block read, so the memory reads overlap with arithmetic instead of following it.
  struct Later {
    const cache_t* cache = nullptr;
    const int64_t* blocks = nullptr;
    int64_t head = 0, begin = 0, end = 0;  // block indices [begin, end) of the sequence's table
  };

  Later later(const cache_t* cache, int64_t seq, int64_t head, int64_t first_block, int64_t len) const {
    return {cache, table + seq * table_width, head, first_block, (len + block_size - 1) / block_size};
  }

  // scores[r * span + (t - origin)] = scale * q_r . key_t for the `rows` query rows against the sequence's keys t
  // in [origin, len), origin = first_block * block_size.
  template <typename scalar_t>
  void score(int64_t seq, int64_t head, QueryRows<scalar_t, cache_t>& q, int64_t rows, int64_t first_block,
             int64_t len, float* scores, int64_t span) const {
#if PAGEDLLM_DPBF16
    if constexpr (QueryRows<scalar_t, cache_t>::kBf16) {
      if (q.pairwise) {
        const Later values_ahead = later(values, seq, head, first_block, len);
        pass(seq, head, keys, values_ahead, first_block, len, [&](const cache_t* k, int64_t, int64_t b, int64_t n) {
          block_scores_bf16(q.raw.data(), rows, k, n, dim, q.scale, scores + (b - first_block) * block_size, span);
        });
        return;
      }
    }
#endif
    const float* scaled = q.scaled.data();
    if constexpr (quantized)
      for (int64_t r = 0; r < rows; ++r) {
        float sum = 0.f;
        for (int64_t d = 0; d < dim; ++d) sum += scaled[r * dim + d];
        q.sums[r] = sum;
      }
    const Later values_ahead = later(values, seq, head, first_block, len);
    pass(seq, head, keys, values_ahead, first_block, len, [&](const cache_t* k, int64_t slot, int64_t b, int64_t n) {
      block_scores(scaled, q.sums.data(), rows, k, quantized ? key_scale + slot : nullptr,
                   quantized ? key_min + slot : nullptr, n, dim, scores + (b - first_block) * block_size, span);
    });
  }

  // acc[r] += sum_t probs[r * span + (t - origin)] * value_t over the same keys.
  void accumulate(int64_t seq, int64_t head, const float* probs, int64_t rows, int64_t first_block, int64_t len,
                  int64_t span, float* acc, const Later& next_keys = {}) const {
    pass(seq, head, values, next_keys, first_block, len, [&](const cache_t* v, int64_t slot, int64_t b, int64_t n) {
      block_accumulate(probs + (b - first_block) * block_size, span, rows, v,
                       quantized ? value_scale + slot : nullptr, quantized ? value_min + slot : nullptr, n, dim, acc);
    });
  }

 private:
  // Blocks are prefetched this many ahead: one block of a few KiB does not cover a memory round trip.
  static constexpr int64_t kPrefetchDistance = 2;

  template <typename F>
  void pass(int64_t seq, int64_t head, const cache_t* cache, const Later& ahead, int64_t first_block, int64_t len,
            F&& use) const {
    const int64_t* blocks = table + seq * table_width;
    const int64_t end_block = (len + block_size - 1) / block_size;
    const int64_t block_bytes = block_size * dim * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t b = first_block; b < std::min(end_block, first_block + kPrefetchDistance); ++b)
      prefetch_block(cache + (blocks[b] * kv_heads + head) * block_size * dim, block_bytes);
    for (int64_t b = first_block; b < end_block; ++b) {
      const int64_t slot = (blocks[b] * kv_heads + head) * block_size;  // the block's first slot
      const int64_t rows = std::min(len, (b + 1) * block_size) - b * block_size;
      if (b + kPrefetchDistance < end_block)
        prefetch_block(cache + (blocks[b + kPrefetchDistance] * kv_heads + head) * block_size * dim, block_bytes);
      const int64_t k = ahead.begin + (b - first_block);
      if (ahead.cache != nullptr && k < ahead.end)
        prefetch_block<1>(ahead.cache + (ahead.blocks[k] * kv_heads + ahead.head) * block_size * dim, block_bytes);
      use(cache + slot * dim, slot, b, rows);
    }
  }
};

// Sequences whose shared prefix blocks are attended together (query rows = kSeqTile * group size).
constexpr int64_t kSeqTile = 16;

#if PAGEDLLM_DPBF16
// Tile GEMMs through torch's brgemm: pair-interleaved packing and a softmax that rounds to bf16.
constexpr int64_t kKeyTile = 64;
constexpr int64_t kKeyStep = 16;  // the last key tile of a query tile is cut to a multiple of this many keys

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// probs[0, span) = bf16(exp(scale * (s[t] - max))) for the `visible` scores, then zeros; returns 1 / sum of the
// float32 numerators. Sixteen lanes at a time (s has room for span floats, span a multiple of Vec::size).
inline float scaled_softmax_bf16(float* s, int64_t visible, int64_t span, float scale, at::BFloat16* probs,
                                 float* peak_out = nullptr) {
  const int64_t full = visible / Vec::size * Vec::size;
  Vec top = Vec::broadcast(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < full; t += Vec::size) top = Vec::max(top, Vec::load(s + t));
  float peak = top.max();
  for (int64_t t = full; t < visible; ++t) peak = std::max(peak, s[t]);
  for (int64_t t = visible; t < round_up(visible, Vec::size); ++t) s[t] = -std::numeric_limits<float>::infinity();
  const Vec shift = Vec::broadcast(peak), vscale = Vec::broadcast(scale);
  Vec total = Vec::zero();
  for (int64_t t = 0; t < visible; t += Vec::size) {  // the lanes past `visible` give exp(-inf) = 0
    const Vec e = Vec::exp_nonpositive((Vec::load(s + t) - shift) * vscale);
    total = total + e;
    e.store(probs + t);
  }
  std::fill(probs + round_up(visible, Vec::size), probs + span, at::BFloat16(0.f));
  if (peak_out != nullptr) *peak_out = peak * scale;  // the largest scaled score
  return 1.f / total.sum();
}

// Positions [t0, t0 + kKeyTile) of one sequence's keys and values for one KV head, read through its block table
// (positions at or past `n` read `zeros`: their probabilities are zero too), in brgemm's pair-interleaved layout:
// keys [dim / 2][key_ld][2] (B of Q K^T; the tile's columns of a wider packing when key_ld > kKeyTile), values
// [kKeyTile / 2][dim][2] (B of P V).
inline void pack_tile(const at::BFloat16* key_cache, const at::BFloat16* value_cache, const int64_t* blocks,
                      int64_t kv_heads, int64_t block_size, int64_t head, int64_t t0, int64_t n, int64_t dim,
                      const uint16_t* zeros, int64_t key_ld, at::BFloat16* keys, at::BFloat16* values) {
  const uint16_t* krow[kKeyTile];
  const uint16_t* vrow[kKeyTile];
  for (int64_t i = 0; i < kKeyTile; ++i) {
    const int64_t t = t0 + i;
    const int64_t row = (blocks[t / block_size] * kv_heads + head) * block_size + t % block_size;
    krow[i] = t < n ? reinterpret_cast<const uint16_t*>(key_cache + row * dim) : zeros;
    vrow[i] = t < n ? reinterpret_cast<const uint16_t*>(value_cache + row * dim) : zeros;
  }
  uint32_t* pk = reinterpret_cast<uint32_t*>(keys);
  for (int64_t p = 0; p < dim / 2; ++p)
    for (int64_t i = 0; i < kKeyTile; ++i) pk[p * key_ld + i] = reinterpret_cast<const uint32_t*>(krow[i])[p];
  // Values: rows i and i + 1 interleaved element by element, 32 of each at a time, then one by one.
  const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                              38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i second_half = _mm512_add_epi16(first_half, _mm512_set1_epi16(16));
  const int64_t whole = dim / 32 * 32;
  uint16_t* pv = reinterpret_cast<uint16_t*>(values);
  for (int64_t i = 0; i < kKeyTile; i += 2) {
    uint16_t* pair = pv + (i / 2) * dim * 2;
    for (int64_t d = 0; d < whole; d += 32) {
      const __m512i a = _mm512_loadu_si512(vrow[i] + d), b = _mm512_loadu_si512(vrow[i + 1] + d);
      _mm512_storeu_si512(pair + 2 * d, _mm512_permutex2var_epi16(a, first_half, b));
      _mm512_storeu_si512(pair + 2 * d + 32, _mm512_permutex2var_epi16(a, second_half, b));
    }
    for (int64_t d = whole; d < dim; ++d) {
      pair[2 * d] = vrow[i][d];
      pair[2 * d + 1] = vrow[i + 1][d];
    }
  }
}

// The shared prefix of bf16 decodes over a bf16 cache as tile GEMMs (see prefill_bf16_brgemm below): its keys and
// values are packed once per KV head, then each tile of kSeqTile sequences times the group's heads is two GEMM
// passes, scores in float32 and probabilities rounded to bf16. Writes what the per-row path writes: the
// unnormalized sums, the largest scaled score and the sum of numerators of each (sequence, query head).
void shared_prefix_bf16_brgemm(const at::BFloat16* q_ptr, int64_t q_seq_stride, int64_t q_head_stride,
                               const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks,
                               int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t block_size,
                               int64_t dim, int64_t shared_len, double scale, float* shared_acc, float* shared_max,
                               float* shared_sum) {
  using bf16 = at::BFloat16;
  const int64_t groups = num_heads / kv_heads, span = round_up(shared_len, kKeyTile), key_tiles = span / kKeyTile;
  // Per KV head, the whole prefix as one GEMM operand each: keys [dim / 2][span][2], values [span / 2][dim][2].
  const auto packed_k = uninitialized<bf16>(kv_heads * span * dim);
  const auto packed_v = uninitialized<bf16>(kv_heads * span * dim);
  const std::vector<uint16_t> zeros(dim, 0);
  at::parallel_for(0, kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_tiles, t0 = (item % key_tiles) * kKeyTile;
      pack_tile(keys, values, blocks, kv_heads, block_size, h, t0, shared_len, dim, zeros.data(), span,
                packed_k.get() + h * span * dim + t0 * 2, packed_v.get() + h * span * dim + t0 * dim);
    }
  });
  const int64_t seq_tiles = (num_seqs + kSeqTile - 1) / kSeqTile;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, seq_tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const auto q = uninitialized<bf16>(kSeqTile * groups * dim);
    const auto probs = uninitialized<bf16>(kSeqTile * groups * span);
    std::vector<float> scores(kSeqTile * groups * span), acc(kSeqTile * groups * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_seq = (item / kv_heads) * kSeqTile, head = item % kv_heads;
      const int64_t rows = std::min(kSeqTile, num_seqs - first_seq) * groups;  // row j * groups + g
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* src =
            q_ptr + (first_seq + r / groups) * q_seq_stride + (head * groups + r % groups) * q_head_stride;
        std::copy(src, src + dim, q.get() + r * dim);
      }
      at::native::cpublas::brgemm(rows, span, dim, dim, span, span, false, q.get(),
                                  packed_k.get() + head * span * dim, scores.data(), true);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
        shared_sum[at] = 1.f / scaled_softmax_bf16(scores.data() + r * span, shared_len, span, fscale,
                                                   probs.get() + r * span, &shared_max[at]);
      }
      at::native::cpublas::brgemm(rows, dim, span, span, dim, dim, false, probs.get(),
                                  packed_v.get() + head * span * dim, acc.data(), true);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
        std::copy(acc.begin() + r * dim, acc.begin() + (r + 1) * dim, shared_acc + at * dim);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#endif

template <typename scalar_t, typename cache_t>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
            const c10::optional<at::Tensor>& key_min, const c10::optional<at::Tensor>& value_scale,
            const c10::optional<at::Tensor>& value_min, const at::Tensor& block_table,
            const at::Tensor& seq_lens, double scale, int64_t window, const c10::optional<at::Tensor>& new_keys,
            const c10::optional<at::Tensor>& new_values, const c10::optional<at::Tensor>& slots,
            int64_t shared_blocks) {
  const int64_t num_seqs = query.size(0);
  const PagedCache<cache_t> cache(key_cache, value_cache, key_scale, key_min, value_scale, value_min, block_table);
  const int64_t num_heads = query.size(1), dim = cache.dim, kv_heads = cache.kv_heads, block_size = cache.block_size;
  const int64_t groups = num_heads / kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  // This step's key and value of each sequence, stored into its slot by the thread that reads the block next: the
  // block read that follows pays for those cache lines once, where a separate row copy would fetch them twice.
  const bool write_new = new_keys.has_value();
  const scalar_t* nk_ptr = write_new ? new_keys->data_ptr<scalar_t>() : nullptr;
  const scalar_t* nv_ptr = write_new ? new_values->data_ptr<scalar_t>() : nullptr;
  const int64_t nk_seq_stride = write_new ? new_keys->stride(0) : 0;
  const int64_t nk_head_stride = write_new ? new_keys->stride(1) : 0;
  const int64_t nv_seq_stride = write_new ? new_values->stride(0) : 0;
  const int64_t nv_head_stride = write_new ? new_values->stride(1) : 0;
  const int64_t* slot_ptr = write_new ? slots->data_ptr<int64_t>() : nullptr;
  cache_t* k_out = const_cast<cache_t*>(cache.keys);
  cache_t* v_out = const_cast<cache_t*>(cache.values);

  // Blocks that every sequence's table starts with (a shared prompt prefix) are attended once per tile of
  // sequences: each block is read once for the tile's query rows instead of once per sequence. Their unnormalized
  // sums, maxima and softmax denominators are merged with each sequence's own blocks below.
  const int64_t shared_len = shared_blocks * block_size;
  std::vector<float> shared_acc, shared_max, shared_sum;
  if (shared_blocks > 0) {
    shared_acc.resize(num_seqs * num_heads * dim);
    shared_max.resize(num_seqs * num_heads);
    shared_sum.resize(num_seqs * num_heads);
    bool done = false;
#if PAGEDLLM_DPBF16
    if constexpr (QueryRows<scalar_t, cache_t>::kBf16)
      if (dim % 32 == 0) {
        shared_prefix_bf16_brgemm(q_ptr, q_seq_stride, q_head_stride, cache.keys, cache.values, cache.table, num_seqs,
                                  num_heads, kv_heads, block_size, dim, shared_len, scale, shared_acc.data(),
                                  shared_max.data(), shared_sum.data());
        done = true;
      }
#endif
    if (!done) {
      const int64_t tiles = (num_seqs + kSeqTile - 1) / kSeqTile;
      at::parallel_for(0, tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
        QueryRows<scalar_t, cache_t> q(kSeqTile * groups, dim, scale);
        std::vector<float> acc(kSeqTile * groups * dim), scores(kSeqTile * groups * shared_len);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t first_seq = (item / kv_heads) * kSeqTile, head = item % kv_heads;
          const int64_t rows = std::min(kSeqTile, num_seqs - first_seq) * groups;  // row j * groups + g
          for (int64_t r = 0; r < rows; ++r)
            q.set(r, q_ptr + (first_seq + r / groups) * q_seq_stride + (head * groups + r % groups) * q_head_stride);
          cache.score(first_seq, head, q, rows, 0, shared_len, scores.data(), shared_len);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
            shared_sum[at] = 1.f / softmax_numerators(scores.data() + r * shared_len, shared_len, &shared_max[at]);
          }
          std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
          cache.accumulate(first_seq, head, scores.data(), rows, 0, shared_len, shared_len, acc.data());
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
            std::copy(acc.begin() + r * dim, acc.begin() + (r + 1) * dim, shared_acc.begin() + at * dim);
          }
        }
      });
    }
  }

  // The first key a sequence of `len` tokens reads here: past the window, or past the shared prefix.
  const auto first_key = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : shared_len; };
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    QueryRows<scalar_t, cache_t> q(groups, dim, scale);
    std::vector<float> acc(groups * dim), scores, inv_sum(groups);
    std::vector<float> peak(groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = first_key(len);
      if (write_new) {
        const int64_t slot = slot_ptr[seq];
        const int64_t row = ((slot / block_size) * kv_heads + head) * block_size + slot % block_size;
        store_row(k_out + row * dim, nk_ptr + seq * nk_seq_stride + head * nk_head_stride, dim);
        store_row(v_out + row * dim, nv_ptr + seq * nv_seq_stride + head * nv_head_stride, dim);
      }
      for (int64_t g = 0; g < groups; ++g) q.set(g, q_ptr + seq * q_seq_stride + (head * groups + g) * q_head_stride);
      // Scores are laid out per block-aligned position from the first block, so blocks never straddle rows.
      const int64_t first_block = first / block_size, end_block = (len + block_size - 1) / block_size;
      const int64_t origin = first_block * block_size, span = end_block * block_size - origin;
      scores.resize(groups * span);
      // Pass 1: scores of every query head of the group against every cached key, block by block.
      cache.score(seq, head, q, groups, first_block, len, scores.data(), span);
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * span;
        const int64_t lo = first - origin, hi = len - origin;  // the keys this query may see
        inv_sum[g] = softmax_numerators(s + lo, hi - lo, &peak[g]);
        std::fill(s, s + lo, 0.f);
        std::fill(s + hi, s + span, 0.f);
      }
      // Pass 2: the probability-weighted sum of the values, while the next item's keys are fetched.
      typename PagedCache<cache_t>::Later next_keys;
      if (item + 1 < end) {
        const int64_t next_seq = (item + 1) / kv_heads, next_len = lens[next_seq];
        next_keys = cache.later(cache.keys, next_seq, (item + 1) % kv_heads, first_key(next_len) / block_size,
                                next_len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      cache.accumulate(seq, head, scores.data(), groups, first_block, len, span, acc.data(), next_keys);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = seq * num_heads + head * groups + g;
        scalar_t* dst = out_ptr + at * dim;
        if (shared_blocks > 0) {  // merged with the shared prefix's part, both rescaled to the larger maximum
          const float top = std::max(peak[g], shared_max[at]);
          const float own = exp_nonpositive(peak[g] - top), prefix = exp_nonpositive(shared_max[at] - top);
          const float inv = 1.f / (own / inv_sum[g] + prefix * shared_sum[at]);
          const float* part = shared_acc.data() + at * dim;
          for (int64_t d = 0; d < dim; ++d)
            dst[d] = static_cast<scalar_t>((acc[g * dim + d] * own + part[d] * prefix) * inv);
        } else {
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv_sum[g]);
        }
      }
    }
  });
}

// Prompt chunks attended straight from the paged cache (their keys and values are already stored): one work item
// per (chunk, KV head, tile of kTile query tokens). The tile's query heads of the group become rows of one
// score matrix [rows, span] over the blocks the tile can see, each row softmaxed up to its own position (causal,
// and the window when there is one). No gather of the cached prefix, no padding of short chunks to long ones.
constexpr int64_t kTile = 16;

template <typename scalar_t, typename cache_t>
void prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& key_min,
             const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& value_min,
             const at::Tensor& block_table, const at::Tensor& past_lens, const at::Tensor& q_starts,
             const at::Tensor& q_lens, double scale, int64_t window) {
  const int64_t num_chunks = q_starts.size(0);
  const PagedCache<cache_t> cache(key_cache, value_cache, key_scale, key_min, value_scale, value_min, block_table);
  const int64_t num_heads = query.size(1), dim = cache.dim, kv_heads = cache.kv_heads, block_size = cache.block_size;
  const int64_t groups = num_heads / kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* past = past_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);

  // (chunk, first token of the tile) for every tile, times the KV heads below.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t = 0; t < lens[c]; t += kTile) tiles.emplace_back(c, t);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * kv_heads;
  // Later tiles of a long chunk see more keys: threads take every n-th item rather than a contiguous run of them,
  // so each gets a share of the costly ones.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const int64_t per_thread = (num_items + threads - 1) / threads;

  at::parallel_for(0, threads * per_thread, per_thread, [&](int64_t begin, int64_t end) {
    QueryRows<scalar_t, cache_t> q(kTile * groups, dim, scale);
    std::vector<float> acc(kTile * groups * dim), scores;
    std::vector<float> inv_sum(kTile * groups);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = (k % per_thread) * threads + k / per_thread;
      if (item >= num_items) continue;
      const auto [chunk, tile_start] = tiles[item / kv_heads];
      const int64_t head = item % kv_heads;
      const int64_t tokens = std::min(kTile, lens[chunk] - tile_start);
      const int64_t rows = tokens * groups;  // row j * groups + g: query token j of the tile, head g of the group
      const int64_t first_pos = past[chunk] + tile_start;  // position of the tile's first query token
      const int64_t end_len = first_pos + tokens;           // keys [0, end_len) may be seen by some row
      const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g)
          q.set(j * groups + g,
                q_ptr + (starts[chunk] + tile_start + j) * q_tok_stride + (head * groups + g) * q_head_stride);
      const int64_t first_block = first / block_size, end_block = (end_len + block_size - 1) / block_size;
      const int64_t origin = first_block * block_size, span = end_block * block_size - origin;
      scores.resize(rows * span);
      cache.score(chunk, head, q, rows, first_block, end_len, scores.data(), span);
      for (int64_t j = 0; j < tokens; ++j) {
        const int64_t pos = first_pos + j;
        const int64_t lo = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - origin, hi = pos + 1 - origin;
        for (int64_t g = 0; g < groups; ++g) {
          float* s = scores.data() + (j * groups + g) * span;
          inv_sum[j * groups + g] = softmax_numerators(s + lo, hi - lo);
          std::fill(s, s + lo, 0.f);
          std::fill(s + hi, s + span, 0.f);
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
      cache.accumulate(chunk, head, scores.data(), rows, first_block, end_len, span, acc.data());
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          scalar_t* dst = out_ptr + ((starts[chunk] + tile_start + j) * num_heads + head * groups + g) * dim;
          const float* a = acc.data() + (j * groups + g) * dim;
          const float inv = inv_sum[j * groups + g];
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
    }
  });
}

#if PAGEDLLM_DPBF16
// bf16 prompt chunks over a bf16 cache as tile GEMMs through torch's brgemm (oneDNN micro-kernels: AMX tiles where
// the CPU has them, AVX512_BF16 dot products otherwise). Each (chunk, KV head) gets its keys and values packed once
// into brgemm's pair-interleaved layout; each tile of kTile query tokens times the group's heads is then two GEMM
// passes over kKeyTile-key slices: scores = Q K^T in float32, softmax in float32, probabilities rounded to bf16,
// out = P V accumulated in float32. No sliding window (the per-row path takes those).
void prefill_bf16_brgemm(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& past_lens,
                         const at::Tensor& q_starts, const at::Tensor& q_lens, double scale) {
  using bf16 = at::BFloat16;
  const int64_t num_chunks = q_starts.size(0), num_heads = query.size(1), kv_heads = key_cache.size(1);
  const int64_t block_size = key_cache.size(2), dim = key_cache.size(3), groups = num_heads / kv_heads;
  const int64_t width = block_table.size(1);
  const bf16* keys = key_cache.data_ptr<bf16>();
  const bf16* values = value_cache.data_ptr<bf16>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* past = past_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const bf16* q_ptr = query.data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);

  // Keys and values are packed per key tile of kKeyTile positions: keys [dim / 2][kKeyTile][2] (B of Q K^T), values
  // [kKeyTile / 2][dim][2] (B of P V), per KV head. A full tile holds whatever its cache rows hold, so chunks that
  // share cached prefix blocks share its packing: a system prompt is packed once per step, not once per request.
  std::vector<int64_t> padded(num_chunks), first_tile(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    padded[c] = round_up(past[c] + lens[c], kKeyTile);
    first_tile[c + 1] = first_tile[c] + padded[c] / kKeyTile;
  }
  std::vector<int64_t> packed_index(first_tile.back());  // (chunk's tile) -> its packed tile
  std::vector<std::pair<int64_t, int64_t>> sources;  // packed tile -> (chunk, first position) to read it from
  std::map<std::vector<int64_t>, int64_t> full_tiles;  // (offset in its first block, block ids) -> packed tile
  std::vector<int64_t> rows_of;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t0 = 0; t0 < padded[c]; t0 += kKeyTile) {
      int64_t& index = packed_index[first_tile[c] + t0 / kKeyTile];
      if (t0 + kKeyTile <= past[c] + lens[c]) {
        rows_of.assign(1, t0 % block_size);
        for (int64_t b = t0 / block_size; b <= (t0 + kKeyTile - 1) / block_size; ++b)
          rows_of.push_back(table[c * width + b]);
        const auto [it, added] = full_tiles.emplace(rows_of, static_cast<int64_t>(sources.size()));
        index = it->second;
        if (!added) continue;
      } else {
        index = static_cast<int64_t>(sources.size());
      }
      sources.emplace_back(c, t0);
    }
  const int64_t tile_elems = kKeyTile * dim;
  const int64_t packed_elems = static_cast<int64_t>(sources.size()) * kv_heads * tile_elems;
  const auto packed_k = uninitialized<bf16>(packed_elems), packed_v = uninitialized<bf16>(packed_elems);
  const std::vector<uint16_t> zeros(dim, 0);
  at::parallel_for(0, static_cast<int64_t>(sources.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [c, t0] = sources[item / kv_heads];
      pack_tile(keys, values, table + c * width, kv_heads, block_size, item % kv_heads, t0, past[c] + lens[c], dim,
                zeros.data(), kKeyTile, packed_k.get() + item * tile_elems, packed_v.get() + item * tile_elems);
    }
  });

  std::vector<std::pair<int64_t, int64_t>> tiles;  // (chunk, first token of the tile)
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t = 0; t < lens[c]; t += kTile) tiles.emplace_back(c, t);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const int64_t per_thread = (num_items + threads - 1) / threads;
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, threads * per_thread, per_thread, [&](int64_t begin, int64_t end) {
    std::vector<bf16> q(kTile * groups * dim), probs;
    std::vector<float> scores, acc(kTile * groups * dim), inv_sum(kTile * groups);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = (k % per_thread) * threads + k / per_thread;  // every n-th: later tiles cost more
      if (item >= num_items) continue;
      const auto [chunk, tile_start] = tiles[item / kv_heads];
      const int64_t head = item % kv_heads, tokens = std::min(kTile, lens[chunk] - tile_start);
      const int64_t rows = tokens * groups;  // row j * groups + g
      const int64_t first_pos = past[chunk] + tile_start, span = round_up(first_pos + tokens, kKeyTile);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const bf16* src =
              q_ptr + (starts[chunk] + tile_start + j) * q_tok_stride + (head * groups + g) * q_head_stride;
          std::copy(src, src + dim, q.data() + (j * groups + g) * dim);
        }
      const auto packed = [&](const std::unique_ptr<bf16[]>& all, int64_t pos) {
        return all.get() + (packed_index[first_tile[chunk] + pos / kKeyTile] * kv_heads + head) * tile_elems;
      };
      // Keys past the tile's last token are masked for every row: the last key tile is cut at a multiple of
      // kKeyStep past it, which saves the masked corner of a causal prompt's work.
      const int64_t seen = round_up(first_pos + tokens, kKeyStep);
      const auto width = [&](int64_t k0) { return std::min(kKeyTile, seen - k0); };
      scores.resize(rows * span);
      for (int64_t n0 = 0; n0 < seen; n0 += kKeyTile)
        at::native::cpublas::brgemm(rows, width(n0), dim, dim, kKeyTile, span, false, q.data(),
                                    packed(packed_k, n0), scores.data() + n0, true);
      probs.resize(rows * span);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = j * groups + g;
          inv_sum[r] = scaled_softmax_bf16(scores.data() + r * span, first_pos + j + 1, seen, fscale,
                                           probs.data() + r * span);
        }
      for (int64_t k0 = 0; k0 < seen; k0 += kKeyTile)
        at::native::cpublas::brgemm(rows, dim, width(k0), span, dim, dim, k0 > 0, probs.data() + k0,
                                    packed(packed_v, k0), acc.data(), true);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = j * groups + g;
          bf16* dst = out_ptr + ((starts[chunk] + tile_start + j) * num_heads + head * groups + g) * dim;
          const Vec inv = Vec::broadcast(inv_sum[r]);
          for (int64_t d = 0; d < dim; d += Vec::size) (Vec::load(acc.data() + r * dim + d) * inv).store(dst + d);
        }
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#endif

template <typename scalar_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& key_min, const c10::optional<at::Tensor>& value_scale,
                    const c10::optional<at::Tensor>& value_min, const at::Tensor& block_table,
                    const at::Tensor& seq_lens, double scale, int64_t window,
                    const c10::optional<at::Tensor>& new_keys, const c10::optional<at::Tensor>& new_values,
                    const c10::optional<at::Tensor>& slots, int64_t shared_blocks) {
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode<scalar_t, float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                              block_table, seq_lens, scale, window, new_keys, new_values, slots,
                              shared_blocks);
      break;
    case at::kBFloat16:
      decode<scalar_t, at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale,
                                     value_min, block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                     shared_blocks);
      break;
    case at::kByte:
      decode<scalar_t, uint8_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                shared_blocks);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported cache dtype ", key_cache.scalar_type());
  }
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size]; block_table: int64 [num_seqs, width]; seq_lens: int64 [num_seqs]
// (counting this step's token). new_keys/new_values [num_seqs, kv_heads, head_size] and slots int64 [num_seqs], when
// given, are written into the caches first (float and bfloat16 caches). The first shared_blocks columns of
// block_table must be the same blocks for every sequence (a shared prefix, full blocks, each sequence longer).
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scale,
                            c10::optional<at::Tensor> key_min, c10::optional<at::Tensor> value_scale,
                            c10::optional<at::Tensor> value_min, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<at::Tensor> new_keys, c10::optional<at::Tensor> new_values,
                            c10::optional<at::Tensor> slots, int64_t shared_blocks) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous(), "query rows and out must be contiguous");
  if (new_keys.has_value()) {
    TORCH_CHECK(new_values.has_value() && slots.has_value(), "new_keys needs new_values and slots");
    TORCH_CHECK(new_keys->scalar_type() == query.scalar_type() && new_values->scalar_type() == query.scalar_type(),
                "new keys and values must have the query's dtype");
    TORCH_CHECK(new_keys->stride(2) == 1 && new_values->stride(2) == 1, "new key and value rows must be contiguous");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous(), "slots must be contiguous int64");
    TORCH_CHECK(key_cache.scalar_type() != at::kByte, "u8 caches are written before the call");
  }
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table and seq_lens must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(shared_blocks >= 0 && shared_blocks <= block_table.size(1), "shared_blocks out of range");
  if (shared_blocks > 0) {
    TORCH_CHECK(window <= 0, "shared_blocks cannot be used with a sliding window");
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < seq_lens.size(0); ++i)
      TORCH_CHECK(lens[i] > shared_blocks * key_cache.size(2), "every sequence must extend past its shared blocks");
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                            block_table, seq_lens, scale, window, new_keys, new_values, slots,
                            shared_blocks);
      break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                   block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                   shared_blocks);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported query dtype ", query.scalar_type());
  }
}

// Prompt chunks over the paged cache, their keys and values already stored. out, query: [num_tokens, num_heads,
// head_size] (the step's tokens; only the chunks' rows of out are written); block_table int64 [num_chunks, width];
// past_lens (tokens cached before the chunk), q_starts (first row of the chunk in query), q_lens: int64 [num_chunks].
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             c10::optional<at::Tensor> key_scale, c10::optional<at::Tensor> key_min,
                             c10::optional<at::Tensor> value_scale, c10::optional<at::Tensor> value_min,
                             at::Tensor block_table, at::Tensor past_lens, at::Tensor q_starts, at::Tensor q_lens,
                             double scale, int64_t window) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous(), "query rows and out must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(), "out must match query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  for (const at::Tensor* t : {&block_table, &past_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "block_table and lengths must be contiguous int64");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const bool is_float = query.scalar_type() == at::kFloat;
  TORCH_CHECK(is_float || query.scalar_type() == at::kBFloat16, "paged prefill attention: unsupported query dtype ",
              query.scalar_type());
#if PAGEDLLM_DPBF16
  if (!is_float && key_cache.scalar_type() == at::kBFloat16 && window <= 0 && key_cache.size(3) % 2 == 0) {
    prefill_bf16_brgemm(out, query, key_cache, value_cache, block_table, past_lens, q_starts, q_lens, scale);
    return;
  }
#endif
  switch (key_cache.scalar_type()) {
#define PAGEDLLM_PREFILL(cache_t)                                                                                  \
  if (is_float)                                                                                                    \
    prefill<float, cache_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,        \
                            block_table, past_lens, q_starts, q_lens, scale, window);                              \
  else                                                                                                             \
    prefill<at::BFloat16, cache_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min, \
                                   block_table, past_lens, q_starts, q_lens, scale, window);                       \
  break;
    case at::kFloat: PAGEDLLM_PREFILL(float)
    case at::kBFloat16: PAGEDLLM_PREFILL(at::BFloat16)
    case at::kByte: PAGEDLLM_PREFILL(uint8_t)
#undef PAGEDLLM_PREFILL
    default:
      TORCH_CHECK(false, "paged prefill attention: unsupported cache dtype ", key_cache.scalar_type());
  }
}

// Stores tokens' keys and values [T, kv_heads, head_size] (rows contiguous, any strides above) into float or bfloat16
// caches at their slots int64 [T]: one pass, where a torch row copy first makes the strided rows contiguous.
void store_kv_rows(at::Tensor key_cache, at::Tensor value_cache, at::Tensor keys, at::Tensor values, at::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "store_kv_rows: contiguous caches");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() && key_cache.scalar_type() != at::kByte,
              "store_kv_rows: float or bfloat16 caches");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 && values.stride(2) == 1 &&
                  keys.scalar_type() == values.scalar_type(),
              "store_kv_rows: keys and values [T, kv_heads, head_size] with contiguous rows, of one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == keys.size(0),
              "store_kv_rows: one int64 slot per token");
  const int64_t tokens = keys.size(0), heads = key_cache.size(1), block_size = key_cache.size(2),
                dim = key_cache.size(3);
  TORCH_CHECK(keys.size(1) == heads && keys.size(2) == dim, "store_kv_rows: rows do not match the cache");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto run = [&](auto cache_tag, auto src_tag) {
    using cache_t = decltype(cache_tag);
    using src_t = decltype(src_tag);
    cache_t* kc = key_cache.data_ptr<cache_t>();
    cache_t* vc = value_cache.data_ptr<cache_t>();
    const src_t* k = keys.data_ptr<src_t>();
    const src_t* v = values.data_ptr<src_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = ((slot[t] / block_size) * heads + h) * block_size + slot[t] % block_size;
          store_row(kc + row * dim, k + t * keys.stride(0) + h * keys.stride(1), dim);
          store_row(vc + row * dim, v + t * values.stride(0) + h * values.stride(1), dim);
        }
    });
  };
  const bool float_cache = key_cache.scalar_type() == at::kFloat, float_src = keys.scalar_type() == at::kFloat;
  TORCH_CHECK(float_src || keys.scalar_type() == at::kBFloat16, "store_kv_rows: float or bfloat16 rows");
  if (float_cache)
    float_src ? run(float{}, float{}) : run(float{}, at::BFloat16{});
  else
    float_src ? run(at::BFloat16{}, float{}) : run(at::BFloat16{}, at::BFloat16{});
}
