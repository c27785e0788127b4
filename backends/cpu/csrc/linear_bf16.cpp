// bf16 linear layers as tile GEMMs through torch's brgemm (oneDNN micro-kernels: AVX512_BF16, AMX tiles where the
// CPU has them), over weights packed once into column blocks. oneDNN's matmul primitive pays a per-call cost that
// dominates at decode sizes; the micro-kernel call does not.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "utils.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_LINEAR_BF16 1
#else
#define PAGEDLLM_LINEAR_BF16 0
#endif

using pagedllm::cdiv;

namespace {

constexpr int64_t kColumns = 64;  // output columns per packed weight block
constexpr int64_t kHalf = kColumns / 2;
// Rows per micro-kernel call. brgemm compiles a kernel per shape, so rows come in tiles of at most this many: one
// kernel per tile height, not per batch size.
constexpr int64_t kRowTile = 64;

}  // namespace

bool linear_bf16_available() { return PAGEDLLM_LINEAR_BF16; }

// weight [N, K] -> [ceil(N / kColumns)][K / 2][kColumns][2]: brgemm's pair-interleaved B operand of each block of
// columns, the last block padded with zero columns.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "a 2-d bf16 weight is required");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = cdiv(n, kColumns);
  TORCH_CHECK(k % 2 == 0, "the input width must be even (pairs of bf16), got ", k);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = weight.new_zeros({blocks, k / 2, kColumns, 2});
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < std::min(kColumns, n - b * kColumns); ++c) {
        const uint16_t* row = src + (b * kColumns + c) * k;
        uint16_t* out = dst + b * k * kColumns + c * 2;
        for (int64_t p = 0; p < k / 2; ++p) {
          out[p * kColumns * 2] = row[2 * p];
          out[p * kColumns * 2 + 1] = row[2 * p + 1];
        }
      }
  });
  return packed;
}

#if PAGEDLLM_LINEAR_BF16
namespace {

// One call's operands: x's rows as brgemm's A ([m, k] with a row stride), the packed weight, the bias in float32,
// and the output [..., out_features].
struct Operands {
  at::Tensor rows, out, bias;
  int64_t m, k, lda;
  const at::BFloat16* a;
  const at::BFloat16* w;
  const float* bias_ptr;
  void* y;

  Operands(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias_in,
           int64_t out_features, at::ScalarType out_dtype = at::kBFloat16) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 input and weight");
    k = packed.size(1) * 2;
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
    w = packed.data_ptr<at::BFloat16>();
    bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
    y = out.data_ptr();
  }
};

// Calls tile(block, first row, rows, first column in the block, columns, scratch) for every work unit: (column block,
// row tile, half of the block's columns) in that order, split evenly over the threads. A block's weights stay in cache
// while the row tiles pass over them. A thread runs both halves of a block as one call and shares a block with the
// next thread only at the ends of its range, so that 9 or 15 blocks still keep two threads equally busy. The scratch
// holds two [kRowTile, kColumns] float32 tiles.
template <typename Tile>
void for_each_tile(int64_t blocks, int64_t m, const Tile& tile) {
  const int64_t tiles = cdiv(m, kRowTile), units = blocks * tiles * 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float scratch[2 * kRowTile * kColumns];
    for (int64_t u = begin; u < end;) {
      const int64_t half = u % 2, r0 = (u / 2 % tiles) * kRowTile, b = u / 2 / tiles;
      const bool both = half == 0 && u + 1 < end;
      u += both ? 2 : 1;
      tile(b, r0, std::min(kRowTile, m - r0), half * kHalf, both ? kColumns : kHalf, scratch);
    }
    at::native::cpublas::brgemm_release(true);
  });
}

inline __mmask16 lanes_from(int64_t j, int64_t width) {
  return j + 16 <= width ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (width - j)) - 1);
}

}  // namespace
#endif

// x [..., K] bf16 times the packed weight of `out_features` columns, plus an optional bias: [..., out_features],
// summed in float32 and rounded once to bf16, or kept in float32 when `float_output` (logits: the sampler's dtype,
// without a bf16 rounding that ties near-equal tokens).
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, bool float_output) {
#if PAGEDLLM_LINEAR_BF16
  const int64_t blocks = packed.size(0), n = out_features;
  TORCH_CHECK(blocks == cdiv(n, kColumns), "packed weight does not hold ", n, " columns");
  const Operands op(x, packed, bias, n, float_output ? at::kFloat : at::kBFloat16);
  if (op.m == 0) return op.out;
  const int64_t k = op.k, lda = op.lda;
  for_each_tile(blocks, op.m, [&](int64_t b, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* c) {
    const int64_t col0 = b * kColumns + c0, width = std::min(cols, n - col0);
    if (width <= 0) return;  // the zero padding of the last block
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, op.a + r0 * lda,
                                op.w + b * k * kColumns + c0 * 2, c, true);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t offset = (r0 + r) * n + col0;
      for (int64_t j = 0; j < width; j += 16) {
        const __mmask16 lanes = lanes_from(j, width);
        __m512 v = _mm512_load_ps(c + r * kColumns + j);
        if (op.bias_ptr != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, op.bias_ptr + col0 + j));
        if (float_output)
          _mm512_mask_storeu_ps(static_cast<float*>(op.y) + offset + j, lanes, v);
        else
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(op.y) + offset + j, lanes, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  });
  return op.out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a build with AVX512_BF16");
#endif
}

// SwiGLU's silu(gate) * up straight from the gate and up projections, without their [..., 2 * width] output: the
// packed weight alternates blocks of gate and up columns (gate block i, then up block i; an optional bias the same,
// padded), and each tile's epilogue combines the two. gate and up are rounded to bf16 first, as the unfused path's
// projection output is, so the result equals linear_bf16 followed by silu_and_mul bit for bit.
at::Tensor linear_silu_and_mul_bf16(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias, int64_t width) {
#if PAGEDLLM_LINEAR_BF16
  const int64_t pairs = packed.size(0) / 2;
  TORCH_CHECK(packed.size(0) % 2 == 0 && pairs == cdiv(width, kColumns),
              "packed weight does not hold gate and up blocks of ", width, " columns");
  const Operands op(x, packed, bias, width);
  if (op.m == 0) return op.out;
  const int64_t k = op.k, lda = op.lda;
  for_each_tile(pairs, op.m, [&](int64_t p, int64_t r0, int64_t rows, int64_t c0, int64_t cols, float* gate) {
    const int64_t col0 = p * kColumns + c0, valid = std::min(cols, width - col0);
    if (valid <= 0) return;
    float* up = gate + kRowTile * kColumns;
    const at::BFloat16* gate_block = op.w + 2 * p * k * kColumns + c0 * 2;
    const at::BFloat16* a = op.a + r0 * lda;
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, a, gate_block, gate, true);
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, a, gate_block + k * kColumns, up, true);
    const float* gate_bias = op.bias_ptr == nullptr ? nullptr : op.bias_ptr + 2 * p * kColumns + c0;
    for (int64_t r = 0; r < rows; ++r) {
      uint16_t* dst = static_cast<uint16_t*>(op.y) + (r0 + r) * width + col0;
      for (int64_t j = 0; j < valid; j += 16) {
        pagedllm::Vec g{_mm512_load_ps(gate + r * kColumns + j)}, u{_mm512_load_ps(up + r * kColumns + j)};
        if (gate_bias != nullptr) {
          g = g + pagedllm::Vec::load(gate_bias + j);
          u = u + pagedllm::Vec::load(gate_bias + kColumns + j);
        }
        const pagedllm::Vec v = pagedllm::silu16(g.rounded_to_bf16()) * u.rounded_to_bf16();
        _mm256_mask_storeu_epi16(dst + j, lanes_from(j, valid), (__m256i)_mm512_cvtneps_pbh(v.v));
      }
    }
  });
  return op.out;
#else
  TORCH_CHECK(false, "linear_silu_and_mul_bf16 needs a build with AVX512_BF16");
#endif
}
