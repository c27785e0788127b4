// bf16 linear layers as tile GEMMs through torch's brgemm (oneDNN micro-kernels: AVX512_BF16, AMX tiles where the
// CPU has them), over weights packed once into column blocks. oneDNN's matmul primitive pays a per-call cost that
// dominates at decode sizes; the micro-kernel call does not.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_LINEAR_BF16 1
#else
#define PAGEDLLM_LINEAR_BF16 0
#endif

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
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kColumns - 1) / kColumns;
  TORCH_CHECK(k % 2 == 0, "the input width must be even (pairs of bf16), got ", k);
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::zeros({blocks, k / 2, kColumns, 2}, weight.options());
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

// x [..., K] bf16 times the packed weight of `out_features` columns, plus an optional bias: [..., out_features] bf16,
// summed in float32 and rounded once. Each block's weights stay in cache while the row tiles pass over them.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features) {
#if PAGEDLLM_LINEAR_BF16
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 input and weight");
  const int64_t k = packed.size(1) * 2, blocks = packed.size(0);
  TORCH_CHECK(x.size(-1) == k, "input width ", x.size(-1), " does not match the weight's ", k);
  TORCH_CHECK(blocks == (out_features + kColumns - 1) / kColumns, "packed weight does not hold ", out_features,
              " columns");
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0), lda = rows.stride(0), n = out_features;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (m == 0) return out;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  const at::BFloat16* a = rows.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Work units (column block, row tile, half of the block's columns) in that order, split evenly over the threads:
  // a block's weights stay in cache while the row tiles pass over them. A thread runs both halves of a block as one
  // call and shares a block with the next thread only at the ends of its range, so that 9 or 15 blocks still keep
  // two threads equally busy.
  const int64_t tiles = (m + kRowTile - 1) / kRowTile, units = blocks * tiles * 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kRowTile * kColumns];
    for (int64_t u = begin; u < end;) {
      const int64_t half = u % 2, r0 = (u / 2 % tiles) * kRowTile, b = u / 2 / tiles;
      const bool both = half == 0 && u + 1 < end;
      u += both ? 2 : 1;
      const int64_t c0 = half * kHalf, cols = both ? kColumns : kHalf;
      const int64_t col0 = b * kColumns + c0, width = std::min(cols, n - col0);
      if (width <= 0) continue;  // the zero padding of the last block
      const int64_t tile = std::min(kRowTile, m - r0);
      at::native::cpublas::brgemm(tile, cols, k, lda, kColumns, kColumns, false, a + r0 * lda,
                                  w + b * k * kColumns + c0 * 2, c, true);
      const __mmask16 tail = static_cast<__mmask16>((1u << (width % 16)) - 1);
      for (int64_t r = 0; r < tile; ++r) {
        uint16_t* dst = y + (r0 + r) * n + col0;
        for (int64_t j = 0; j < width; j += 16) {
          const __mmask16 lanes = j + 16 <= width ? static_cast<__mmask16>(0xffff) : tail;
          __m512 v = _mm512_load_ps(c + r * kColumns + j);
          if (bias_ptr != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias_ptr + col0 + j));
          _mm256_mask_storeu_epi16(dst + j, lanes, (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
#else
  TORCH_CHECK(false, "linear_bf16 needs a build with AVX512_BF16");
#endif
}
