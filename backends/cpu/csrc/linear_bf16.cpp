// bf16 linear layers as tile GEMMs through torch's brgemm (oneDNN micro-kernels: AVX512_BF16, AMX tiles where the
// CPU has them), over weights packed once into column blocks. oneDNN's matmul primitive pays a per-call cost that
// dominates at decode sizes; the micro-kernel call does not.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "brgemm_tiles.h"
#include "utils.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_LINEAR_BF16 1
#else
#define PAGEDLLM_LINEAR_BF16 0
#endif

using pagedllm::cdiv;
using pagedllm::kColumns;
using pagedllm::kHalf;
using pagedllm::kRowTile;

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
struct NoState {};
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
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "a bf16 packed weight is required");
  const pagedllm::LinearOperands op(x, packed.size(1) * 2, bias, n, float_output ? at::kFloat : at::kBFloat16);
  if (op.m == 0) return op.out;
  const int64_t k = op.k, lda = op.lda;
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  pagedllm::for_each_tile<NoState>(blocks, op.m, [&](NoState&, int64_t b, int64_t r0, int64_t rows, int64_t c0,
                                                     int64_t cols, float* c) {
    const int64_t col0 = b * kColumns + c0, width = std::min(cols, n - col0);
    if (width <= 0) return;  // the zero padding of the last block
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, op.a + r0 * lda,
                                w + b * k * kColumns + c0 * 2, c, true);
    char* y = static_cast<char*>(op.y) + (r0 * n + col0) * (float_output ? 4 : 2);
    pagedllm::store_tile(c, rows, width, kColumns, op.bias_ptr == nullptr ? nullptr : op.bias_ptr + col0, y, n,
                         float_output);
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
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "a bf16 packed weight is required");
  const pagedllm::LinearOperands op(x, packed.size(1) * 2, bias, width, at::kBFloat16);
  if (op.m == 0) return op.out;
  const int64_t k = op.k, lda = op.lda;
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  pagedllm::for_each_tile<NoState>(pairs, op.m, [&](NoState&, int64_t p, int64_t r0, int64_t rows, int64_t c0,
                                                    int64_t cols, float* gate) {
    const int64_t col0 = p * kColumns + c0, valid = std::min(cols, width - col0);
    if (valid <= 0) return;
    float* up = gate + kRowTile * kColumns;
    const at::BFloat16* gate_block = w + 2 * p * k * kColumns + c0 * 2;
    const at::BFloat16* a = op.a + r0 * lda;
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, a, gate_block, gate, true);
    at::native::cpublas::brgemm(rows, cols, k, lda, kColumns, kColumns, false, a, gate_block + k * kColumns, up,
                                true);
    const float* gate_bias = op.bias_ptr == nullptr ? nullptr : op.bias_ptr + 2 * p * kColumns + c0;
    pagedllm::store_silu_and_mul_tile(gate, up, rows, valid, kColumns, gate_bias,
                                      gate_bias == nullptr ? nullptr : gate_bias + kColumns,
                                      static_cast<uint16_t*>(op.y) + r0 * width + col0, width);
  });
  return op.out;
#else
  TORCH_CHECK(false, "linear_silu_and_mul_bf16 needs a build with AVX512_BF16");
#endif
}
