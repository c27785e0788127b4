// bf16 linear layers over block-quantized weights (quantized_weights.h), with bf16 activations:
// - many rows (prompt chunks, large batches): each block of 64 output columns is dequantized to bf16 in registers,
//   panel by panel straight into brgemm's pair-interleaved B layout in a thread's scratch, and every row tile is
//   multiplied by it there (oneDNN's micro-kernels: AMX tiles or AVX512_BF16). A row's result is bit for bit what
//   the dense bf16 linear (linear_bf16.cpp) gives over the dequantized weight.
// - a few rows (a decode step's): each panel's values are dotted with the rows by vdpbf16ps as they stream by, 16
//   columns per vector, and scaled per group.
// Either way the weights are read once per call at their quantized size, and the activations are not rounded to
// int8 (quantized_linear.cpp's faster, less precise path).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "brgemm_tiles.h"
#include "quantized_lanes.h"
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
using pagedllm::kColumns;
using pagedllm::kHalf;
using pagedllm::kPanel;
using Weights = pagedllm::QuantizedWeights;

// Pairs of 4-bit values as bf16 pairs 128 + u: or-ing u into the mantissa of 128.0 (0x4300) is exact, and the
// offsets' term takes the 128 back (gemv_panel's `magic`).
inline __m512i magic_pairs(__m512i v, int shift) {
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(0x000F000F),
                                   _mm512_set1_epi32(0x43004300), 0xEA);  // (a & b) | c
}

// The 16 columns of panel p as bf16 pairs, into dst in brgemm's B layout of ldb columns: dst[q * ldb + c] is the
// pair of inputs 2q and 2q + 1 of column c, as one 32-bit word; w = scale * u + offset, rounded once.
template <int Bits>
void dequantize_panel(const Weights& w, int64_t p, uint32_t* dst, int64_t ldb) {
  const uint8_t* panel = w.panel(p);
  const int64_t per_load = Bits == 8 ? 4 : 8;
  const __m512i mask = _mm512_set1_epi32(Bits == 8 ? 0xFF : 0x0F);
  // bf16 element 2c from the first operand's lane c, 2c + 1 from the second's
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(interleave);
  __m512 scale = _mm512_setzero_ps(), offset = scale;
  for (int64_t l = 0; l < w.k / per_load; ++l) {
    if (l * per_load % w.group == 0) {  // a group's first load: its scales (converted once for its loads)
      const int64_t g = l * per_load / w.group;
      scale = pagedllm::group_lanes(w, w.scales, p, g, 0);
      offset = pagedllm::offset_lanes(w, scale, p, g, 0);
    }
    const __m512i v = _mm512_loadu_si512(Weights::load_at(panel, Bits, l));
    const __m512i high = pagedllm::has_high_bits(Bits) ? _mm512_loadu_si512(Weights::high_at(panel, Bits, l)) : v;
    for (int q = 0; q < per_load / 2; ++q) {
      // 4 to 6 bits: pair q in nibbles q and q + 4; 8 bits: pair q in bytes q and q + 2
      const int first = Bits == 8 ? 8 * q : 4 * q, second = first + 16;
      __m512i u_even = _mm512_and_si512(_mm512_srli_epi32(v, first), mask);
      __m512i u_odd = _mm512_and_si512(_mm512_srli_epi32(v, second), mask);
      if (pagedllm::has_high_bits(Bits)) {
        const int j = static_cast<int>(l % pagedllm::unit_loads(Bits));
        u_even = pagedllm::with_high_bits(u_even, high, Bits, j, q, 0x30);
        u_odd = pagedllm::with_high_bits(u_odd, high, Bits, j, q + 4, 0x30);
      }
      const __m512 even = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u_even), scale, offset);
      const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u_odd), scale, offset);
      const __m512i pairs = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
      _mm512_storeu_si512(dst + (l * per_load / 2 + q) * ldb, pairs);
    }
  }
}

// Per row and group, the float32 sum of the row's bf16 inputs (the offsets' term).
std::vector<float> group_sums(const at::BFloat16* x, int64_t lda, int64_t m, const Weights& w) {
  std::vector<float> sums(m * w.groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {  // a group is 16 or 32 inputs: one or two vectors
      pagedllm::Vec s = pagedllm::Vec::zero();
      for (int64_t i = g * w.group; i < (g + 1) * w.group; i += pagedllm::Vec::size)
        s = s + pagedllm::Vec::load(x + r * lda + i);
      sums[r * w.groups + g] = s.sum();
    }
  return sums;
}

// Rows r0 .. r0 + R - 1 of x (bf16, row stride lda) times panel p, 16 columns at a time: vdpbf16ps sums the exact
// products of each bf16 input pair with the pair of values 128 + u (exact in bf16) per group, and the group's sum
// is scaled: sum(w x) = scale * sum((128 + u) x) + (offset - 128 * scale) * sum(x). 8-bit values split into their
// nibbles, u = 16 * high + low. No weight is rounded to bf16, so this is nearer float32 than the dense bf16 linear.
template <int Bits, int R>
void gemv_panel(const Weights& w, int64_t p, const at::BFloat16* x, int64_t lda, const float* sums, float* out) {
  const uint8_t* panel = w.panel(p);
  const int64_t per_load = Bits == 8 ? 4 : 8, loads = w.group / per_load;
  const float magic = Bits == 8 ? 16.f * 128.f + 128.f : 128.f;
  const uint32_t* pairs[R];
  for (int r = 0; r < R; ++r) pairs[r] = reinterpret_cast<const uint32_t*>(x + r * lda);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 a[R], b[R];  // two sums per row: alternate pairs (4 bits), low and high nibbles (8 bits)
    for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_ps();
    // load l's products; J: which load of its unit it is
    const auto load_products = [&](int64_t l, auto unit_load) PAGEDLLM_INLINE {
      constexpr int J = decltype(unit_load)::value;
      Weights::prefetch_ahead(panel, Bits, l);
      const uint8_t* at = Weights::load_at(panel, Bits, l), *highs = Weights::high_at(panel, Bits, l);
      const __m512i v = _mm512_loadu_si512(at);
      const __m512i high = pagedllm::has_high_bits(Bits) ? _mm512_loadu_si512(highs) : v;
      if (Bits != 8) {
        for (int q = 0; q < 4; ++q) {
          const __m512i low = magic_pairs(v, 4 * q);  // 5 and 6 bits: u below 64, so 128 + u is still exact in bf16
          const __m512bh weights = (__m512bh)(pagedllm::has_high_bits(Bits)
                                                  ? pagedllm::with_high_bits(low, high, Bits, J, q, 0x00300030)
                                                  : low);
          for (int r = 0; r < R; ++r) {
            const __m512bh input = (__m512bh)_mm512_set1_epi32(pairs[r][4 * l + q]);
            if (q % 2 == 0)
              a[r] = _mm512_dpbf16_ps(a[r], weights, input);
            else
              b[r] = _mm512_dpbf16_ps(b[r], weights, input);
          }
        }
      } else {
        for (int q = 0; q < 2; ++q) {
          const __m512bh low_nibbles = (__m512bh)magic_pairs(v, 8 * q);
          const __m512bh high_nibbles = (__m512bh)magic_pairs(v, 8 * q + 4);
          for (int r = 0; r < R; ++r) {
            const __m512bh input = (__m512bh)_mm512_set1_epi32(pairs[r][2 * l + q]);
            a[r] = _mm512_dpbf16_ps(a[r], low_nibbles, input);
            b[r] = _mm512_dpbf16_ps(b[r], high_nibbles, input);
          }
        }
      }
    };
    pagedllm::for_each_load<Bits>(g * loads, (g + 1) * loads, load_products);
    const __m512 scale = pagedllm::group_lanes(w, w.scales, p, g, 0);
    const __m512 rest = _mm512_fnmadd_ps(_mm512_set1_ps(magic), scale, pagedllm::offset_lanes(w, scale, p, g, 0));
    for (int r = 0; r < R; ++r) {
      const __m512 sum = Bits != 8 ? _mm512_add_ps(a[r], b[r]) : _mm512_fmadd_ps(b[r], _mm512_set1_ps(16.f), a[r]);
      acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(rest, _mm512_set1_ps(sums[r * w.groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kPanel, acc[r]);
}

template <int Bits>
void gemv_rows(const Weights& w, int64_t p, const at::BFloat16* x, int64_t lda, const float* sums, int64_t rows,
               float* out) {
  switch (rows) {
    case 4: return gemv_panel<Bits, 4>(w, p, x, lda, sums, out);
    case 3: return gemv_panel<Bits, 3>(w, p, x, lda, sums, out);
    case 2: return gemv_panel<Bits, 2>(w, p, x, lda, sums, out);
    default: return gemv_panel<Bits, 1>(w, p, x, lda, sums, out);
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
    for (int64_t first = c0; first < c0 + width; first += kPanel) {
      const int half = static_cast<int>(first / kHalf);
      if (halves_ & (1 << half)) continue;
      const int64_t p = (row0 + first) / kPanel;
      pagedllm::with_bits(w.bits, [&](auto bits) {
        dequantize_panel<decltype(bits)::value>(w, p, pairs_.get() + first, kColumns);
      });
      if (first + kPanel >= c0 + width || (first + kPanel) % kHalf == 0) halves_ |= 1 << half;
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
                                 const at::Tensor& offsets,
                                 const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                                 int64_t out_features,
                                 const c10::optional<at::Tensor>& bias, bool float_output) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  const int64_t n = w.n;
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
                                              const at::Tensor& scales, const at::Tensor& offsets,
                                              const at::Tensor& multipliers, int64_t bits,
                                              int64_t group, int64_t zero,
                                              const c10::optional<at::Tensor>& bias, int64_t width) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, 2 * width);
  TORCH_CHECK(width % kPanel == 0, "a [gate; up] weight whose halves are whole panels of 16 columns is required");
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
                               const at::Tensor& offsets,
                               const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                               int64_t out_features,
                               const c10::optional<at::Tensor>& bias, bool float_output) {
#if PAGEDLLM_QUANTIZED_BF16
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  const int64_t n = w.n;
  const pagedllm::LinearOperands op(x, w.k, bias, n, float_output ? at::kFloat : at::kBFloat16);
  const int64_t m = op.m, lda = op.lda;
  const float* bias_ptr = op.bias_ptr;
  const at::BFloat16* a = op.a;
  void* y = op.y;
  const std::vector<float> sums = group_sums(a, lda, m, w);
  at::parallel_for(0, w.panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float result[4 * kPanel];
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t count = std::min<int64_t>(4, m - r0);
        const float* row_sums = sums.data() + r0 * w.groups;
        pagedllm::with_bits(w.bits, [&](auto bits) {
          gemv_rows<decltype(bits)::value>(w, p, a + r0 * lda, lda, row_sums, count, result);
        });
        const int64_t columns = std::min<int64_t>(kPanel, n - p * kPanel);
        for (int64_t r = 0; r < count; ++r)
          for (int64_t c = 0; c < columns; ++c) {
            const int64_t col = p * kPanel + c;
            const float v = result[r * kPanel + c] + (bias_ptr != nullptr ? bias_ptr[col] : 0.f);
            if (float_output)
              static_cast<float*>(y)[(r0 + r) * n + col] = v;
            else
              static_cast<at::BFloat16*>(y)[(r0 + r) * n + col] = at::BFloat16(v);
          }
      }
  });
  return op.out;
#else
  TORCH_CHECK(false, "quantized_gemv_bf16 needs a build with AVX512_BF16");
#endif
}
