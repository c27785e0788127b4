// bf16 linear layers over block-quantized weights (quantized_weights.h), with bf16 activations:
// - many rows (prompt chunks, large batches): each block of 64 output columns is dequantized to bf16 in registers,
//   straight into brgemm's pair-interleaved B layout in a thread's scratch, and every row tile is multiplied by it
//   there (oneDNN's micro-kernels: AMX tiles or AVX512_BF16). A row's result is bit for bit what the dense bf16
//   linear (linear_bf16.cpp) gives over the dequantized weight.
// - a few rows (a decode step's): each chunk of a column is dequantized to bf16 in registers and dotted with the
//   rows by vdpbf16ps as it streams by.
// Either way the weights are read once per call at their quantized size, and the activations are not rounded to
// int8 (quantized_linear.cpp's faster, less precise path).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "brgemm_tiles.h"
#include "quantized_weights.h"
#include "utils.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_QUANTIZED_BF16 1
#else
#define PAGEDLLM_QUANTIZED_BF16 0
#endif

#if PAGEDLLM_QUANTIZED_BF16
namespace {

using pagedllm::cdiv;
using pagedllm::kChunk;
using pagedllm::kColumns;
using pagedllm::kHalf;
using Weights = pagedllm::QuantizedWeights;

// r[i] lane j <-> r[j] lane i, for sixteen 32-bit lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // each 128-bit lane now holds a 4x4 block; gather the blocks
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);       // 128-bit lanes 0, 2 of both
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);   // lanes 1, 3
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Chunk j of a column (its values, scales and offsets) as 32 bf16, inputs in order (16 pairs): w = scale * u +
// offset, rounded once. g0 and g1 are the groups of inputs 0-15 and 16-31.
template <int Bits>
inline __m512i chunk_bf16(const uint8_t* column, const float* scales, const float* offsets, int64_t j, int64_t g0,
                          int64_t g1) {
  __m512i low, high;  // inputs 0-15 and 16-31 as int32
  if (Bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + j * (kChunk / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    low = _mm512_cvtepu8_epi32(_mm_and_si128(packed, mask));
    high = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask));
  } else {
    low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + j * kChunk)));
    high = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + j * kChunk + 16)));
  }
  const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(low), _mm512_set1_ps(scales[g0]), _mm512_set1_ps(offsets[g0]));
  const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(scales[g1]), _mm512_set1_ps(offsets[g1]));
  return (__m512i)_mm512_cvtne2ps_pbh(f1, f0);
}

// Columns n0 .. n0 + 15 into dst, brgemm's B layout of ldb columns: dst[p * ldb + c] is the bf16 pair of inputs 2p
// and 2p + 1 of column c, as one 32-bit word. Columns past `count` repeat the last one: the tile's results for them
// are never stored.
template <int Bits>
void dequantize_16_columns(const Weights& w, int64_t n0, int64_t count, uint32_t* dst, int64_t ldb) {
  const uint8_t* columns[16];
  const float* scales[16];
  const float* offsets[16];
  for (int64_t c = 0; c < 16; ++c) {
    const int64_t n = n0 + std::min(c, count - 1);
    columns[c] = w.values + n * w.row_bytes();
    scales[c] = w.scales + n * w.groups;
    offsets[c] = w.offsets + n * w.groups;
  }
  const int64_t two_groups = w.group == 16 ? 1 : 0;  // a chunk is one group of 32 or two of 16
  __m512i r[16];
  for (int64_t j = 0; j < w.k / kChunk; ++j) {
    const int64_t g0 = j << two_groups, g1 = g0 + two_groups;
    for (int64_t c = 0; c < 16; ++c) r[c] = chunk_bf16<Bits>(columns[c], scales[c], offsets[c], j, g0, g1);
    transpose16(r);  // r[p] holds pair p of the chunk for the 16 columns
    for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (j * 16 + p) * ldb, r[p]);
  }
}

// Rows r0 .. r0 + R - 1 of x (bf16, row stride lda) dotted with column n, each chunk of the column dequantized to
// bf16 in registers once for all R rows: vdpbf16ps sums the exact products of bf16 weights and bf16 activations in
// float32, as the dense bf16 GEMM does, in another order. Two accumulators per row, for even and odd chunks.
template <int Bits, int R>
void gemv_column(const Weights& w, int64_t n, const at::BFloat16* x, int64_t lda, float* result) {
  const uint8_t* column = w.values + n * w.row_bytes();
  const float* scales = w.scales + n * w.groups;
  const float* offsets = w.offsets + n * w.groups;
  const int64_t two_groups = w.group == 16 ? 1 : 0;
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  const auto step = [&](int64_t j, __m512* sums) {
    const int64_t g0 = j << two_groups;
    const __m512bh weights = (__m512bh)chunk_bf16<Bits>(column, scales, offsets, j, g0, g0 + two_groups);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(x + r * lda + j * kChunk);
      sums[r] = _mm512_dpbf16_ps(sums[r], weights, a);
    }
  };
  const int64_t chunks = w.k / kChunk;
  int64_t j = 0;
  for (; j + 1 < chunks; j += 2) {
    step(j, even);
    step(j + 1, odd);
  }
  if (j < chunks) step(j, even);
  for (int r = 0; r < R; ++r) result[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r]));
}

template <int Bits>
void gemv_columns(const Weights& w, int64_t n, const at::BFloat16* x, int64_t lda, int64_t rows, float* result) {
  switch (rows) {
    case 4: return gemv_column<Bits, 4>(w, n, x, lda, result);
    case 3: return gemv_column<Bits, 3>(w, n, x, lda, result);
    case 2: return gemv_column<Bits, 2>(w, n, x, lda, result);
    default: return gemv_column<Bits, 1>(w, n, x, lda, result);
  }
}

// What a thread holds between its tiles: one block's columns dequantized in brgemm's layout, and which halves.
class DequantizedBlock {
 public:
  // Columns c0 .. c0 + width - 1 of the block of weight rows starting at row0 (the block's kColumns output
  // columns), as brgemm's B operand with ldb = kColumns; dequantized unless this thread holds them already.
  const at::BFloat16* columns(const Weights& w, int64_t row0, int64_t c0, int64_t width) {
    if (!pairs_) {  // zeros: a block's columns past the weight's last one are multiplied, never stored
      pairs_.reset(static_cast<uint32_t*>(std::aligned_alloc(64, w.k / 2 * kColumns * 4)));
      std::fill_n(pairs_.get(), w.k / 2 * kColumns, 0u);
    }
    if (row0 != row0_) {
      row0_ = row0;
      halves_ = 0;
    }
    for (int64_t first = c0; first < c0 + width; first += 16) {
      const int half = static_cast<int>(first / kHalf);
      if (halves_ & (1 << half)) continue;
      const int64_t count = std::min<int64_t>(16, c0 + width - first);
      if (w.bits == 4)
        dequantize_16_columns<4>(w, row0 + first, count, pairs_.get() + first, kColumns);
      else
        dequantize_16_columns<8>(w, row0 + first, count, pairs_.get() + first, kColumns);
      if (first + 16 >= c0 + width || (first + 16) % kHalf == 0) halves_ |= 1 << half;
    }
    return reinterpret_cast<const at::BFloat16*>(pairs_.get() + c0);
  }

 private:
  std::unique_ptr<uint32_t[], void (*)(void*)> pairs_{nullptr, &std::free};  // [k / 2][kColumns] pairs of bf16
  int64_t row0_ = -1;
  int halves_ = 0;  // bit h: columns h * kHalf .. h * kHalf + kHalf - 1 are there
};

struct GateAndUp {
  DequantizedBlock gate, up;
};

}  // namespace
#endif

bool quantized_linear_bf16_available() { return PAGEDLLM_QUANTIZED_BF16; }

// x [..., K] bf16 times the quantized weight of N columns (plus an optional bias): [..., N] bf16, or float32 when
// `float_output`. The call splits as the dense bf16 linear's does (brgemm_tiles.h); a thread dequantizes the
// columns of a block once, when its first tile there needs them, so each weight is read and dequantized once per
// call (twice for a block two threads share).
at::Tensor quantized_linear_bf16(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                 const at::Tensor& offsets, int64_t bits, int64_t group,
                                 const c10::optional<at::Tensor>& bias, bool float_output) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, bits, group);
  const int64_t n = values.size(0);
  const pagedllm::LinearOperands op(x, w.k, bias, n, float_output ? at::kFloat : at::kBFloat16);
  if (op.m == 0) return op.out;
  const int64_t element = float_output ? 4 : 2;
  pagedllm::for_each_tile<DequantizedBlock>(cdiv(n, kColumns), op.m, [&](DequantizedBlock& held, int64_t b,
                                                                           int64_t r0, int64_t rows, int64_t c0,
                                                                           int64_t cols, float* c) {
    const int64_t col0 = b * kColumns + c0, width = std::min(cols, n - col0);
    if (width <= 0) return;  // past the last column
    const at::BFloat16* weights = held.columns(w, b * kColumns, c0, width);
    at::native::cpublas::brgemm(rows, cols, w.k, op.lda, kColumns, kColumns, false, op.a + r0 * op.lda, weights, c,
                                true);
    pagedllm::store_tile(c, rows, width, kColumns, op.bias_ptr == nullptr ? nullptr : op.bias_ptr + col0,
                         static_cast<char*>(op.y) + (r0 * n + col0) * element, n, float_output);
  });
  return op.out;
#else
  TORCH_CHECK(false, "quantized_linear_bf16 needs a build with AVX512_BF16");
#endif
}

// SwiGLU's silu(gate) * up from a quantized [gate; up] weight of 2 * width rows (and bias), [..., width] bf16: the
// tiles of gate block i and up block i are multiplied in the same work unit and combined in its epilogue, as
// linear_silu_and_mul_bf16 does over dense weights, without the [..., 2 * width] projection output.
at::Tensor quantized_linear_silu_and_mul_bf16(const at::Tensor& x, const at::Tensor& values,
                                              const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                                              int64_t group, const c10::optional<at::Tensor>& bias,
                                              int64_t width) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, bits, group);
  TORCH_CHECK(values.size(0) == 2 * width, "a [gate; up] weight of ", 2 * width, " rows is required");
  const pagedllm::LinearOperands op(x, w.k, bias, width, at::kBFloat16);
  if (op.m == 0) return op.out;
  pagedllm::for_each_tile<GateAndUp>(cdiv(width, kColumns), op.m, [&](GateAndUp& held, int64_t p, int64_t r0,
                                                                       int64_t rows, int64_t c0, int64_t cols,
                                                                       float* gate) {
    const int64_t col0 = p * kColumns + c0, valid = std::min(cols, width - col0);
    if (valid <= 0) return;
    float* up = gate + pagedllm::kRowTile * kColumns;
    const at::BFloat16* a = op.a + r0 * op.lda;
    at::native::cpublas::brgemm(rows, cols, w.k, op.lda, kColumns, kColumns, false, a,
                                held.gate.columns(w, p * kColumns, c0, valid), gate, true);
    at::native::cpublas::brgemm(rows, cols, w.k, op.lda, kColumns, kColumns, false, a,
                                held.up.columns(w, width + p * kColumns, c0, valid), up, true);
    const float* gate_bias = op.bias_ptr == nullptr ? nullptr : op.bias_ptr + col0;
    pagedllm::store_silu_and_mul_tile(gate, up, rows, valid, kColumns, gate_bias,
                                      gate_bias == nullptr ? nullptr : gate_bias + width,
                                      static_cast<uint16_t*>(op.y) + r0 * width + col0, width);
  });
  return op.out;
#else
  TORCH_CHECK(false, "quantized_linear_silu_and_mul_bf16 needs a build with AVX512_BF16");
#endif
}

// The same product for a few rows (a decode step's), without tiles: each weight is dequantized to bf16 in registers
// and dotted with the rows as it streams by, so a call reads the weights once at their quantized size. Its sums
// run in another order than the tiles', so a row's result may differ from theirs in the last bit.
at::Tensor quantized_gemv_bf16(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                               const at::Tensor& offsets, int64_t bits, int64_t group,
                               const c10::optional<at::Tensor>& bias, bool float_output) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, bits, group);
  const int64_t n = values.size(0);
  const pagedllm::LinearOperands op(x, w.k, bias, n, float_output ? at::kFloat : at::kBFloat16);
  const int64_t m = op.m, lda = op.lda;
  const float* bias_ptr = op.bias_ptr;
  const at::BFloat16* a = op.a;
  void* y = op.y;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float result[4];
    for (int64_t c = begin; c < end; ++c)
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t count = std::min<int64_t>(4, m - r0);
        if (w.bits == 4)
          gemv_columns<4>(w, c, a + r0 * lda, lda, count, result);
        else
          gemv_columns<8>(w, c, a + r0 * lda, lda, count, result);
        for (int64_t r = 0; r < count; ++r) {
          const float v = result[r] + (bias_ptr != nullptr ? bias_ptr[c] : 0.f);
          if (float_output)
            static_cast<float*>(y)[(r0 + r) * n + c] = v;
          else
            static_cast<at::BFloat16*>(y)[(r0 + r) * n + c] = at::BFloat16(v);
        }
      }
  });
  return op.out;
#else
  TORCH_CHECK(false, "quantized_gemv_bf16 needs a build with AVX512_BF16");
#endif
}
