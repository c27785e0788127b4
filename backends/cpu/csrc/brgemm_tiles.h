// How the bf16 linear layers (dense, and quantized ones dequantized to tiles) split a call into brgemm tiles and
// what a tile does with its float32 sums. Shared, so that both kinds of layer split and round alike.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "utils.h"
#include "vec.h"

namespace pagedllm {

constexpr int64_t kColumns = 64;  // output columns per block of weights
constexpr int64_t kHalf = kColumns / 2;
// Rows per micro-kernel call. brgemm compiles a kernel per shape, so rows come in tiles of at most this many: one
// kernel per tile height, not per batch size.
constexpr int64_t kRowTile = 64;

}  // namespace pagedllm

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm {

// Calls tile(state, block, first row, rows, first column in the block, columns, scratch) for every work unit:
// (column block, row tile, half of the block's columns) in that order, split evenly over the threads. A block's
// weights stay in cache while the row tiles pass over them. A thread runs both halves of a block as one call and
// shares a block with the next thread only at the ends of its range, so that 9 or 15 blocks still keep two threads
// equally busy. Each thread has a State of its own (default-constructed); the scratch holds two [kRowTile,
// kColumns] float32 tiles.
template <typename State, typename Tile>
void for_each_tile(int64_t blocks, int64_t m, const Tile& tile) {
  const int64_t tiles = cdiv(m, kRowTile), units = blocks * tiles * 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float scratch[2 * kRowTile * kColumns];
    State state;
    for (int64_t u = begin; u < end;) {
      const int64_t half = u % 2, r0 = (u / 2 % tiles) * kRowTile, b = u / 2 / tiles;
      const bool both = half == 0 && u + 1 < end;
      u += both ? 2 : 1;
      tile(state, b, r0, std::min(kRowTile, m - r0), half * kHalf, both ? kColumns : kHalf, scratch);
    }
    at::native::cpublas::brgemm_release(true);
  });
}

// One call's operands: x's rows [m, k] as brgemm's A (with a row stride), the bias in float32 (or null), and the
// output [..., out_features] in out_dtype.
struct LinearOperands {
  at::Tensor rows, out, bias;
  int64_t m, k, lda;
  const at::BFloat16* a;
  const float* bias_ptr;
  void* y;

  LinearOperands(const at::Tensor& x, int64_t k_, const c10::optional<at::Tensor>& bias_in, int64_t out_features,
                 at::ScalarType out_dtype)
      : k(k_) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "a bf16 input is required");
    TORCH_CHECK(x.size(-1) == k, "input width ", x.size(-1), " does not match the weight's ", k);
    rows = x.reshape({-1, k});
    if (rows.stride(1) != 1) rows = rows.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = out_features;
    out = x.new_empty(shape, x.options().dtype(out_dtype));
    m = rows.size(0);
    lda = rows.stride(0);
    if (bias_in.has_value() && bias_in->defined()) bias = bias_in->to(at::kFloat).contiguous();
    a = rows.data_ptr<at::BFloat16>();
    bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
    y = out.data_ptr();
  }
};

inline __mmask16 lanes_from(int64_t j, int64_t width) {
  return j + 16 <= width ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (width - j)) - 1);
}

// Rows of a tile c ([rows][ldc] float32) plus bias[0..width) into out + r * out_stride (bf16, or float32 when
// float_output); bias may be null.
inline void store_tile(const float* c, int64_t rows, int64_t width, int64_t ldc, const float* bias, void* out,
                       int64_t out_stride, bool float_output) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 lanes = lanes_from(j, width);
      __m512 v = _mm512_load_ps(c + r * ldc + j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + j));
      if (float_output)
        _mm512_mask_storeu_ps(static_cast<float*>(out) + r * out_stride + j, lanes, v);
      else
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * out_stride + j, lanes,
                                 (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// SwiGLU's silu(gate) * up of two tiles' sums ([rows][ldc] float32, plus the biases where not null), gate and up
// rounded to bf16 first as an unfused projection's output is, into bf16 out + r * out_stride.
inline void store_silu_and_mul_tile(const float* gate, const float* up, int64_t rows, int64_t width, int64_t ldc,
                                    const float* gate_bias, const float* up_bias, uint16_t* out,
                                    int64_t out_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 lanes = lanes_from(j, width);
      Vec g{_mm512_load_ps(gate + r * ldc + j)}, u{_mm512_load_ps(up + r * ldc + j)};
      if (gate_bias != nullptr) {
        g = g + Vec{_mm512_maskz_loadu_ps(lanes, gate_bias + j)};
        u = u + Vec{_mm512_maskz_loadu_ps(lanes, up_bias + j)};
      }
      const Vec v = silu16(g.rounded_to_bf16()) * u.rounded_to_bf16();
      _mm256_mask_storeu_epi16(out + r * out_stride + j, lanes, (__m256i)_mm512_cvtneps_pbh(v.v));
    }
}

}  // namespace pagedllm
#endif
