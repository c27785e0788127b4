// What the decode and prefill attention kernels share: a cache element as float, query rows scaled and (for u8
// caches) summed, scores of a block's keys and their weighted sum of its values, the softmax numerators, a row's
// store, the view of a paged cache ([num_blocks, kv_heads, block_size, head_size] in float32, bfloat16, or uint8:
// x = q * scale + minimum, keys with a float32 scale and minimum per block, head and channel, values per token and
// head; see store_kv_u8.cpp), and the bf16 tile helpers for brgemm. Everything here is inline: each kernel file compiles its own copy.
#pragma once

#include <ATen/core/Tensor.h>
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
#include "utils.h"
#include "vec.h"

namespace pagedllm {

// Scratch memory that the caller fills: a std::vector would first write every bf16 element one by one.
template <typename T>
std::unique_ptr<T[]> uninitialized(int64_t n) {
  return std::make_unique_for_overwrite<T[]>(n);
}

// out = x * scale elementwise; returns x . minimum (u8 rows: a query against a block's channel scales and minimums,
// or probabilities against a block's token scales and minimums). In vectors: a scalar sum is a chain of dependent
// adds, paid once per block.
inline float scale_and_dot(const float* x, const float* scale, const float* minimum, int64_t n, float* out) {
  float dot = 0.f;
  int64_t i = 0;
#if defined(PAGEDLLM_VEC)
  Vec acc = Vec::zero();
  for (; i + Vec::size <= n; i += Vec::size) {
    const Vec v = Vec::load(x + i);
    (v * Vec::load(scale + i)).store(out + i);
    acc = Vec::fma(v, Vec::load(minimum + i), acc);
  }
  dot = acc.sum();
#endif
  for (; i < n; ++i) {
    out[i] = x[i] * scale[i];
    dot += x[i] * minimum[i];
  }
  return dot;
}

#if defined(PAGEDLLM_VEC)
// scores[j * stride + t0 + i] = offsets[j] + sum_d qs[j * dim + d] * keys[d * block_size + t0 + i] for R query rows
// and Vec::size tokens from t0: one channel of consecutive tokens per vector load, one FMA per channel and row, no
// horizontal sums.
template <int R>
inline void u8_key_tile(const float* qs, const float* offsets, const uint8_t* keys, int64_t block_size, int64_t dim,
                        int64_t t0, float* scores, int64_t stride) {
  Vec acc[R];
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) acc[j] = Vec::broadcast(offsets[j]);
  for (int64_t d = 0; d < dim; ++d) {
    const Vec k = Vec::load(keys + d * block_size + t0);
#pragma GCC unroll 8
    for (int j = 0; j < R; ++j) acc[j] = Vec::fma(Vec::broadcast(qs[j * dim + d]), k, acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < R; ++j) acc[j].store(scores + j * stride + t0);
}
#endif

// scores[r * stride + t] = q_r . key_t for a block of u8 keys, stored channel-major ([dim][block_size]) with a scale
// and minimum per channel: key_t = q8_t * scale + minimum, so q_r . key_t = (q_r * scale) . q8_t + q_r . minimum.
// Positions [n, block_size) of the scores may be written. qs [rows * dim] and offsets [rows] are scratch.
inline void block_scores_u8(const float* q, int64_t rows, const uint8_t* keys, const float* scale,
                            const float* minimum, int64_t n, int64_t block_size, int64_t dim, float* qs,
                            float* offsets, float* scores, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) offsets[r] = scale_and_dot(q + r * dim, scale, minimum, dim, qs + r * dim);
  int64_t t0 = 0;
#if defined(PAGEDLLM_VEC)
  // A block's last tokens are scored as a whole vector too: the slots past n hold finite stale or zero bytes, and
  // their scores land in positions the callers clear (a scalar tail would cost as much as the rest of the block).
  for (; t0 < n && t0 + Vec::size <= block_size; t0 += Vec::size) {
    using Tile = void (*)(const float*, const float*, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t);
    static constexpr Tile kTiles[] = {nullptr, u8_key_tile<1>, u8_key_tile<2>, u8_key_tile<3>, u8_key_tile<4>};
    for (int64_t r = 0; r < rows; r += 4)
      kTiles[std::min<int64_t>(4, rows - r)](qs + r * dim, offsets + r, keys, block_size, dim, t0, scores + r * stride,
                                             stride);
  }
#endif
  for (; t0 < n; ++t0)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = offsets[r];
      for (int64_t d = 0; d < dim; ++d) sum += qs[r * dim + d] * static_cast<float>(keys[d * block_size + t0]);
      scores[r * stride + t0] = sum;
    }
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
// (bf16 widened in registers; u8 keys go through block_scores_u8).
template <typename cache_t>
inline void block_scores(const float* q, int64_t groups, const cache_t* keys, int64_t rows, int64_t dim,
                         float* scores, int64_t stride) {
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
        sum8(acc, scores + g * stride + r);
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
      scores[g * stride + r] = sum;
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
  std::vector<float> scaled;
  std::vector<float> by_channel, offsets;  // u8 keys: the rows times a block's channel scales, and their offsets
  std::vector<at::BFloat16> raw;

  QueryRows(int64_t max_rows, int64_t dim, double scale)
      : dim(dim), scale(static_cast<float>(scale)), pairwise(kBf16 && dim % 32 == 0) {
    if (std::is_same<cache_t, uint8_t>::value) {
      by_channel.resize(max_rows * dim);
      offsets.resize(max_rows);
    }
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
        const float offset = scale_and_dot(probs + (g0 + j) * stride, scale, minimum, rows, scaled + j * rows);
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
        table_width(block_table.size(1)), kv_heads(value_cache.size(1)), block_size(value_cache.size(2)),
        dim(value_cache.size(3)) {}

  // A later pass over one sequence's blocks of one cache: its blocks are asked for into L2 during the current
  // pass, one per block read, so the memory reads overlap with arithmetic instead of following it.
  struct Later {
    const cache_t* cache = nullptr;
    const int64_t* blocks = nullptr;
    int64_t head = 0, begin = 0, end = 0;  // block indices [begin, end) of the sequence's table
  };

  Later later(const cache_t* cache, int64_t seq, int64_t head, int64_t first_block, int64_t len) const {
    return {cache, table + seq * table_width, head, first_block, cdiv(len, block_size)};
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
    const Later values_ahead = later(values, seq, head, first_block, len);
    pass(seq, head, keys, values_ahead, first_block, len, [&](const cache_t* k, int64_t slot, int64_t b, int64_t n) {
      if constexpr (quantized) {
        block_scores_u8(scaled, rows, k, key_scale + slot / block_size * dim, key_min + slot / block_size * dim, n,
                        block_size, dim, q.by_channel.data(), q.offsets.data(),
                        scores + (b - first_block) * block_size, span);
      } else {
        block_scores(scaled, rows, k, n, dim, scores + (b - first_block) * block_size, span);
      }
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
    const int64_t end_block = cdiv(len, block_size);
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

inline int64_t round_up(int64_t x, int64_t to) { return cdiv(x, to) * to; }

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
#endif  // PAGEDLLM_DPBF16

}  // namespace pagedllm
