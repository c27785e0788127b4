// float32 linear layers over block-quantized weights (quantized_weights.h) for many rows (prompt chunks, large
// batches), on any x86-64 CPU: each block of 64 output columns is dequantized to float32 (w = fma(u, scale, offset),
// as dequantize_weight does) into a thread's scratch in the [k][64] layout of a GEMM's B operand, and the rows are
// multiplied by it there. Each weight is read and dequantized once per call at its quantized size, never held dense.
// - Up to kOwnTileRows rows (a decode step of a large batch): register tiles of rows x 16 columns summed over the
//   whole input width, the rows broadcast straight from x: no packing of the rows per call.
// - More (prompt chunks): torch's float32 GEMM (MKL's sgemm, which blocks a large product for the caches; oneDNN's
//   float32 brgemm is a reference loop on CPUs without AVX-512).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "quantized_lanes.h"
#include "utils.h"

namespace {

using pagedllm::cdiv;
using pagedllm::kPanel;
using Weights = pagedllm::QuantizedWeights;

constexpr int64_t kBlock = 64;     // output columns dequantized together: four panels
constexpr int64_t kMinRows = 16;   // fewest rows a thread's share of one block's rows is split into
constexpr int64_t kOwnTileRows = 256;  // up to this many rows per call, the register tiles; above, MKL's GEMM

// Panel p dequantized into dst: dst[i * ldb + c] is input i of the panel's column c.
void dequantize_panel(const Weights& w, int64_t p, float* dst, int64_t ldb) {
#if PAGEDLLM_QUANT_SIMD
  using pagedllm::kLanes;
  using pagedllm::Lanes;
  const uint8_t* panel = w.panel(p);
  const int64_t per_load = w.inputs_per_load();
  const bool bytes = w.bits == 8;
  const int* input = bytes ? pagedllm::kInputOfByte : pagedllm::kInputOfNibble;
  const Lanes::I mask = Lanes::set1(bytes ? 0xFF : 0x0F);
  Lanes::F scale[Lanes::halves], offset[Lanes::halves];
  for (int64_t l = 0; l < w.k / per_load; ++l) {
    if (l * per_load % w.group == 0) {  // a group's first load: its scales (converted once for its loads)
      const int64_t g = l * per_load / w.group;
      for (int h = 0; h < Lanes::halves; ++h) {
        scale[h] = pagedllm::group_lanes(w, w.scales, p, g, h);
        offset[h] = pagedllm::offset_lanes(w, scale[h], p, g, h);
      }
    }
    for (int h = 0; h < Lanes::halves; ++h) {
      const Lanes::I v = Lanes::load(Weights::load_at(panel, w.bits, l) + h * kLanes * 4);
      const Lanes::I high =
          pagedllm::has_high_bits(w.bits) ? Lanes::load(Weights::high_at(panel, w.bits, l) + h * kLanes * 4) : v;
      for (int e = 0; e < per_load; ++e) {
        Lanes::I u = Lanes::band(Lanes::shr(v, (bytes ? 8 : 4) * e), mask);
        if (pagedllm::has_high_bits(w.bits))
          u = pagedllm::with_high_bits(u, high, static_cast<int>(w.bits),
                                       static_cast<int>(l % pagedllm::unit_loads(w.bits)), e, 0x30);
        Lanes::store(dst + (l * per_load + input[e]) * ldb + h * kLanes,
                     Lanes::fma(Lanes::cvt(u), scale[h], offset[h]));
      }
    }
  }
#else
  for (int64_t i = 0; i < w.k; ++i)
    for (int64_t c = 0; c < kPanel; ++c)
      dst[i * ldb + c] = std::fma(static_cast<float>(w.u(p, c, i)), w.scale(p, i / w.group, c),
                                  w.offset(p, i / w.group, c));
#endif
}

#if PAGEDLLM_QUANT_SIMD
using pagedllm::kLanes;
using pagedllm::Lanes;
// Rows per register tile: MR x (16 columns) accumulators, enough independent sums to hide the FMA's latency (AVX2:
// 12 of the 16 vector registers; AVX-512: 12 of 32).
constexpr int kTileRows = Lanes::halves == 2 ? 6 : 12;

// MR rows of a (row stride lda) times the 16 columns at b (row stride kBlock) over k inputs, into c (row stride ldc).
template <int MR>
void register_tile(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc) {
  Lanes::F acc[MR][Lanes::halves];
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < Lanes::halves; ++h) acc[r][h] = Lanes::zerof();
  for (int64_t i = 0; i < k; ++i) {
    Lanes::F w[Lanes::halves];
    for (int h = 0; h < Lanes::halves; ++h) w[h] = Lanes::loadf(b + i * kBlock + h * kLanes);
    for (int r = 0; r < MR; ++r) {
      const Lanes::F x = Lanes::set1f(a[r * lda + i]);
      for (int h = 0; h < Lanes::halves; ++h) acc[r][h] = Lanes::fma(w[h], x, acc[r][h]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < Lanes::halves; ++h) Lanes::store(c + r * ldc + h * kLanes, acc[r][h]);
}

// register_tile<rows> for 1 <= rows <= kTileRows: the row count is a template argument, so the sums stay in registers.
template <int MR = kTileRows>
void register_tile_rows(int64_t rows, const float* a, int64_t lda, const float* b, int64_t k, float* c,
                        int64_t ldc) {
  if constexpr (MR > 1) {
    if (rows < MR) return register_tile_rows<MR - 1>(rows, a, lda, b, k, c, ldc);
  }
  register_tile<MR>(a, lda, b, k, c, ldc);
}

// Rows [r0, r1) of a ([m, k] float32) times the block's columns [col0, col0 + width) dequantized at b, into out
// ([m, n]): per 16 columns, every tile of rows over them, so that those columns' weights stay in cache.
void multiply_block(const float* a, int64_t k, int64_t r0, int64_t r1, const float* b, int64_t col0, int64_t width,
                    float* out, int64_t n) {
  alignas(64) float partial[kTileRows * kPanel];  // a panel's columns past the last one are not stored in out
  for (int64_t c = 0; c < width; c += kPanel) {
    const bool whole = c + kPanel <= width;
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, r1 - r);
      float* dst = whole ? out + r * n + col0 + c : partial;
      register_tile_rows(rows, a + r * k, k, b + c, k, dst, whole ? n : kPanel);
      if (!whole)
        for (int64_t i = 0; i < rows; ++i)
          std::copy_n(partial + i * kPanel, width - c, out + (r + i) * n + col0 + c);
    }
  }
}
#endif

// Into how many parts each block's rows are split so that both threads stay busy when the weight has few blocks
// (the k and v projections): enough units for four per thread, no part under kMinRows rows.
int64_t row_parts(int64_t blocks, int64_t m) {
  const int64_t threads = at::get_num_threads();
  if (blocks >= 4 * threads) return 1;
  return std::max<int64_t>(1, std::min(cdiv(4 * threads, blocks), m / kMinRows));
}

}  // namespace

// x [..., K] (float32, or bf16 widened) times the quantized weight of N columns, plus an optional bias: [..., N] in
// x's dtype, or float32 when `float_output`. Work units are (block, part of the rows); a thread dequantizes a block
// once for its consecutive units of it.
at::Tensor quantized_linear_tiles_f32(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                      const at::Tensor& offsets,
                                      const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                                      int64_t out_features, const c10::optional<at::Tensor>& bias,
                                      bool float_output) {
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bf16 input");
  TORCH_CHECK(x.size(-1) == w.k, "input width ", x.size(-1), " does not match the weight's ", w.k);
  const at::Tensor rows = x.reshape({-1, w.k}).to(at::kFloat).contiguous();
  const int64_t m = rows.size(0), n = w.n, k = w.k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = rows.new_empty({m, n});
  if (m > 0) {
    const int64_t blocks = cdiv(n, kBlock), parts = row_parts(blocks, m);
    const at::TensorOptions options = rows.options();
    // the worker threads do not inherit the caller's inference mode, which writing into `out` may need
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, blocks * parts, 1, [&](int64_t begin, int64_t end) {
      const c10::InferenceMode mode(inference);
      std::unique_ptr<float[], void (*)(void*)> scratch(
          static_cast<float*>(std::aligned_alloc(64, k * kBlock * sizeof(float))), &std::free);
      int64_t held = -1;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / parts, part = u % parts, col0 = b * kBlock, width = std::min(kBlock, n - col0);
        const int64_t r0 = m * part / parts, r1 = m * (part + 1) / parts;
        if (r1 == r0) continue;
        if (b != held) {
          for (int64_t c = 0; c < width; c += kPanel)
            dequantize_panel(w, (col0 + c) / kPanel, scratch.get() + c, kBlock);
          held = b;
        }
#if PAGEDLLM_QUANT_SIMD
        if (m <= kOwnTileRows) {
          multiply_block(rows.data_ptr<float>(), k, r0, r1, scratch.get(), col0, width, out.data_ptr<float>(), n);
          continue;
        }
#endif
        at::Tensor a = rows.narrow(0, r0, r1 - r0);
        at::Tensor weights = at::from_blob(scratch.get(), {k, width}, {kBlock, 1}, options);
        at::Tensor result = out.narrow(0, r0, r1 - r0).narrow(1, col0, width);
        at::mm_out(result, a, weights);
      }
    });
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  out = out.view(shape);
  return float_output || x.scalar_type() == at::kFloat ? out : out.to(at::kBFloat16);
}
