// Linear layers over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and on-the-fly int8/q4_0),
// for the few rows of a decode step: each panel of 16 columns (quantized_weights.h) is streamed once per call and
// summed against every row while it is in cache, 16 columns per vector. Batch-1 decode is bound by the bytes of
// weights read, so fewer bits per weight is the only way to make it faster.
//
// The activations are quantized per 32 inputs, and integer dot products taken, scaled per group; the offsets' term
// takes the rounded activations' sums, so that a row's result is the weights' product with its rounded activations:
// - int8 (as llama.cpp's Q8 activations): AVX512_VNNI vpdpbusd, else vpmaddubsw; faster, less precise;
// - int16 (vpmaddwd on pairs of inputs, the values as 16-bit halves): the activations rounded to 1 part in 65534 of
//   their chunk's largest, far closer to float32 than bf16 is, in half the vector operations of float32 products
//   with the values converted in registers: float32 models' decode path.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "quantized_lanes.h"

namespace {

using pagedllm::kChunk;
using pagedllm::kPanel;
using Weights = pagedllm::QuantizedWeights;
#if PAGEDLLM_QUANT_SIMD
using pagedllm::kLanes;
using pagedllm::Lanes;
#endif
constexpr int kRows = 4;  // rows summed against one pass over a panel

// The rows as float32 [m, k] (bf16 widened), contiguous.
at::Tensor float_rows(const at::Tensor& rows) {
  return rows.scalar_type() == at::kFloat ? rows.contiguous() : rows.to(at::kFloat).contiguous();
}

// Activations for the integer paths: per row and chunk of 32 inputs, int8 or int16 values q and a scale d with
// x ~ d * q (d = max |x| / 127 or 32767), and per weight group the sum of d * q (the offsets' term). Its error is
// then sum(w * e) over the rounding errors e, as llama.cpp's; the exact sums of x made it sum((w - offset) * e),
// a Q8_0 value x counted as x + 128.
// int8 values are stored in the weight's int8 order (kInt8Order4/8), int16 ones in the inputs' own order (a 32-bit
// word is a pair of neighbouring inputs, as the weights' 16-bit halves are).
template <typename T>
struct IntegerActivations {
  static_assert(std::is_same<T, int8_t>::value || std::is_same<T, int16_t>::value, "int8 or int16");
  static constexpr int kIdentity[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<T> q;
  std::vector<float> scale, group_sum;
  int64_t chunks, groups;
  const int* order;  // input of each position, per 8 inputs

  IntegerActivations(const float* x, int64_t m, int64_t k, int64_t group, int64_t bits)
      : q(m * k), scale(m * (k / kChunk)), group_sum(m * (k / group)), chunks(k / kChunk), groups(k / group),
        order(sizeof(T) == 2 ? kIdentity : bits == 8 ? pagedllm::kInt8Order8 : pagedllm::kInt8Order4) {
    constexpr float kMax = std::numeric_limits<T>::max();
    at::parallel_for(0, m * chunks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const float* src = x + c * kChunk;  // rows are contiguous: chunk c of all rows' chunks
        float amax = 0.f;
        for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(src[i]));
        const float d = amax / kMax, inverse = d > 0.f ? 1.f / d : 0.f;
        scale[c] = d;
        for (int64_t i = 0; i < kChunk; ++i)
          q[c * kChunk + i] = static_cast<T>(std::nearbyint(src[i / 8 * 8 + order[i % 8]] * inverse));
        for (int64_t s = 0; s < kChunk / group; ++s) {  // the chunk's groups (the order moves inputs within 8)
          int32_t total = 0;
          for (int64_t i = s * group; i < (s + 1) * group; ++i) total += q[c * kChunk + i];
          group_sum[c * (kChunk / group) + s] = d * static_cast<float>(total);
        }
      }
    });
  }
};
using Int8Activations = IntegerActivations<int8_t>;
using Int16Activations = IntegerActivations<int16_t>;

// Sums of panel p for rows r0.. (16 per row, one per column) through the integer paths' scalar code.
template <typename T>
void integer_panel_scalar(const Weights& w, int64_t p, const IntegerActivations<T>& act, int64_t r0, int64_t rows,
                          float* sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        int32_t dot = 0;  // over the group's activations, in their order
        for (int64_t t = g * w.group; t < (g + 1) * w.group; ++t)
          dot += w.u(p, c, t / 8 * 8 + act.order[t % 8]) * act.q[(r0 + r) * w.k + t];
        const float d = act.scale[(r0 + r) * act.chunks + g * w.group / kChunk];
        total += static_cast<float>(dot) * (w.scale(p, g, c) * d) +
                 w.offset(p, g, c) * act.group_sum[(r0 + r) * act.groups + g];
      }
      sums[r * kPanel + c] = total;
    }
}

#if PAGEDLLM_QUANT_SIMD
// Steps per load of lane values, and the values of step e as the dot products take them: int8 activations take
// the 4-bit values as bytes (low nibbles, then high ones) or 8-bit ones whole; int16 activations take pairs of
// inputs as 16-bit halves (a shift by e values and a mask). 5-bit and 6-bit values are their nibbles' steps with
// the high bits of load J of their unit (lanes `high`) put above each nibble.
template <typename T, int Bits>
constexpr int kSteps = std::is_same<T, int16_t>::value ? (Bits == 8 ? 2 : 4) : (Bits == 8 ? 1 : 2);

template <typename T, int Bits, int J>
inline Lanes::I step_values(Lanes::I v, Lanes::I high, int e) {
  if (Bits == 8) {
    if (std::is_same<T, int8_t>::value) return v;
    return Lanes::band(e == 0 ? v : Lanes::shr(v, 8 * e), Lanes::set1(0x00FF00FF));
  }
  const bool pairs = std::is_same<T, int16_t>::value;  // else bytes: nibbles 2b + e of the lane's bytes b
  const Lanes::I low = Lanes::band(e == 0 ? v : Lanes::shr(v, pairs ? 4 * e : 4),
                                   Lanes::set1(pairs ? 0x000F000F : 0x0F0F0F0F));
  if (Bits == 4) return low;
  // nibble e's high bits (and those of the nibbles 16 or 8 bits above) moved to bit 4 (and 5)
  return pagedllm::with_high_bits(low, high, Bits, J, e, pairs ? 0x00300030 : 0x30303030);
}

// acc + the lane sums of the values of one step times a broadcast 32-bit word of activations
template <typename T, int Bits>
inline Lanes::I step_dot(Lanes::I acc, Lanes::I u, Lanes::I a) {
  if (std::is_same<T, int16_t>::value) return Lanes::dot2(acc, u, a);
  return Bits == 8 ? Lanes::dot8(acc, u, a) : Lanes::dot4(acc, u, a);
}

// The integer paths over panel p for rows r0 .. r0 + R - 1: per group, integer sums of each load's values with the
// rows' activations, then scaled by the column's scale and the chunk's activation scale, plus the offsets' term.
// A load's halves (AVX2) are summed in the same pass, so that the panel streams from memory once, with the
// prefetches running ahead all the way; a single row sums into two accumulators (steps alternating), whose
// latency (vpdpwssd, vpdpbusd) would stall one chain. `sums` gets [R][16].
template <int R, int Bits, typename T>
void integer_panel(const Weights& w, int64_t p, const IntegerActivations<T>& act, int64_t r0, float* sums) {
  constexpr int H = Lanes::halves, S = kSteps<T, Bits>, C = R * H == 1 ? 2 : 1;
  const uint8_t* panel = w.panel(p);
  const int64_t loads = w.group / (Bits == 8 ? 4 : 8);
  const int32_t* a[R];
  for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const int32_t*>(act.q.data() + (r0 + r) * w.k);
  for (int i = 0; i < R * kPanel; ++i) sums[i] = 0.f;
  for (int64_t g = 0; g < w.groups; ++g) {
    Lanes::I dot[R][H][C];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < C; ++c) dot[r][h][c] = Lanes::zeroi();
    // load l's sums; J: which load of its unit it is
    const auto load_sums = [&](int64_t l, auto unit_load) PAGEDLLM_INLINE {
      constexpr int J = decltype(unit_load)::value;
      Weights::prefetch_ahead(panel, Bits, l);
      const uint8_t* at = Weights::load_at(panel, Bits, l), *highs = Weights::high_at(panel, Bits, l);
      Lanes::I v[H], high[H];
      for (int h = 0; h < H; ++h) {
        v[h] = Lanes::load(at + h * kLanes * 4);
        high[h] = pagedllm::has_high_bits(Bits) ? Lanes::load(highs + h * kLanes * 4) : v[h];
      }
      for (int e = 0; e < S; ++e) {
        Lanes::I u[H];
        for (int h = 0; h < H; ++h) u[h] = step_values<T, Bits, J>(v[h], high[h], e);
        for (int r = 0; r < R; ++r) {
          const Lanes::I word = Lanes::set1(a[r][l * S + e]);
          for (int h = 0; h < H; ++h) dot[r][h][e % C] = step_dot<T, Bits>(dot[r][h][e % C], u[h], word);
        }
      }
    };
    pagedllm::for_each_load<Bits>(g * loads, (g + 1) * loads, load_sums);
    const int64_t chunk = g * w.group / kChunk;
    for (int h = 0; h < H; ++h) {
      const Lanes::F scale = group_lanes(w, w.scales, p, g, h), offset = offset_lanes(w, scale, p, g, h);
      for (int r = 0; r < R; ++r) {
        const Lanes::I total = C == 1 ? dot[r][h][0] : Lanes::addi(dot[r][h][0], dot[r][h][C - 1]);
        const Lanes::F d = Lanes::set1f(act.scale[(r0 + r) * act.chunks + chunk]);
        float* out = sums + r * kPanel + h * kLanes;
        Lanes::F acc = Lanes::fma(Lanes::cvt(total), Lanes::mul(scale, d), Lanes::loadf(out));
        acc = Lanes::fma(offset, Lanes::set1f(act.group_sum[(r0 + r) * act.groups + g]), acc);
        Lanes::store(out, acc);
      }
    }
  }
}

// Kernel<rows, bits>::run(args...) for 1 to kRows rows: the row count is a template argument, so that the
// accumulators stay in registers.
template <typename Run>
inline void with_rows(int64_t rows, const Run& run) {
  static_assert(kRows == 4, "one case per row count");
  switch (rows) {
    case 4: return run(std::integral_constant<int, 4>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 2: return run(std::integral_constant<int, 2>{});
    default: return run(std::integral_constant<int, 1>{});
  }
}
#endif

// Sums [rows][16] of panel p for rows r0.. through an integer path.
template <typename T>
void integer_sums(const Weights& w, int64_t p, const IntegerActivations<T>& act, int64_t r0, int64_t rows,
                  float* sums) {
#if PAGEDLLM_QUANT_SIMD
  with_rows(rows, [&](auto r) {
    pagedllm::with_bits(w.bits, [&](auto bits) {
      integer_panel<decltype(r)::value, decltype(bits)::value>(w, p, act, r0, sums);
    });
  });
#else
  integer_panel_scalar(w, p, act, r0, rows, sums);
#endif
}

void store(const float* sums, int64_t rows, int64_t p, const Weights& w, const float* bias, void* out,
           bool float_output, int64_t r0) {
  const int64_t columns = std::min<int64_t>(kPanel, w.n - p * kPanel);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c) {
      const int64_t n = p * kPanel + c;
      const float v = sums[r * kPanel + c] + (bias != nullptr ? bias[n] : 0.f);
      const int64_t at = (r0 + r) * w.n + n;
      if (float_output)
        static_cast<float*>(out)[at] = v;
      else
        static_cast<at::BFloat16*>(out)[at] = at::BFloat16(v);
    }
}

}  // namespace

bool quantized_linear_int8_simd() {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return true;
#else
  return false;
#endif
}

// x [..., K] (float32 or bf16) times the quantized weight of N columns, plus an optional float bias:
// [..., N] in x's dtype, or float32 when `float_output`. `activation_bits` (8 or 16) picks the path.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets,
                            const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                            int64_t out_features,
                            const c10::optional<at::Tensor>& bias, bool float_output, int64_t activation_bits) {
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bf16 input");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "activations of 8 or 16 bits, got ", activation_bits);
  TORCH_CHECK(x.size(-1) == w.k, "input width ", x.size(-1), " does not match the weight's ", w.k);
  const at::Tensor rows = float_rows(x.reshape({-1, w.k}));
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.n;
  const bool as_float = float_output || x.scalar_type() == at::kFloat;
  at::Tensor out = x.new_empty(shape, x.options().dtype(as_float ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) bias_float = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  const float* xs = rows.data_ptr<float>();
  void* y = out.data_ptr();
  const auto run = [&](const auto& act) {
    at::parallel_for(0, w.panels, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float sums[kRows * kPanel];
      for (int64_t p = begin; p < end; ++p)
        for (int64_t r0 = 0; r0 < m; r0 += kRows) {
          const int64_t count = std::min<int64_t>(kRows, m - r0);
          integer_sums(w, p, act, r0, count, sums);
          store(sums, count, p, w, bias_ptr, y, as_float, r0);
        }
    });
  };
  if (activation_bits == 8)
    run(Int8Activations(xs, m, w.k, w.group, w.bits));
  else
    run(Int16Activations(xs, m, w.k, w.group, w.bits));
  return out;
}

// The whole weight as [N, K] float32 or bf16 (prefill and large batches of float32 models run it through the dense
// GEMMs).
namespace {

// Column c of panel p (output row p * 16 + c of the weight) dequantized into dst[0, k), float32 or bf16.
template <typename T>
void dequantize_column(const Weights& w, int64_t p, int64_t c, T* dst) {
  const bool bytes = w.bits == 8;
  const int* input = bytes ? pagedllm::kInputOfByte : pagedllm::kInputOfNibble;
  const uint32_t mask = bytes ? 0xFF : 0x0F;
  const int64_t per_load = w.inputs_per_load();
  for (int64_t l = 0; l < w.k / per_load; ++l) {
    const int64_t g = l * per_load / w.group;
    const float scale = w.scale(p, g, c), offset = w.offset(p, g, c);
    const uint32_t word = Weights::word(w.load(p, l) + c * 4);
    const bool high_bits = pagedllm::has_high_bits(w.bits);
    const uint32_t high = high_bits ? Weights::word(w.high_load(p, l) + c * 4) : 0;
    for (int e = 0; e < per_load; ++e) {
      uint32_t u = (word >> ((bytes ? 8 : 4) * e)) & mask;
      if (high_bits) u |= pagedllm::high_part(w.bits, high, l, e) << 4;
      dst[l * per_load + input[e]] = static_cast<T>(std::fma(static_cast<float>(u), scale, offset));
    }
  }
}

// Rows ids of the weight (output rows; all of them without ids) as a dense [rows, k] float32 or bf16 tensor.
at::Tensor dequantize(const Weights& w, const at::Tensor& values, const int64_t* ids, int64_t rows, bool bf16) {
  at::Tensor out = values.new_empty({rows, w.k}, values.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / w.k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = ids ? ids[r] : r;
      if (bf16)
        dequantize_column(w, row / kPanel, row % kPanel, out.data_ptr<at::BFloat16>() + r * w.k);
      else
        dequantize_column(w, row / kPanel, row % kPanel, out.data_ptr<float>() + r * w.k);
    }
  });
  return out;
}

}  // namespace

at::Tensor dequantize_weight(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                             const at::Tensor& multipliers,
                             int64_t bits, int64_t group, int64_t zero, int64_t out_features, bool bf16) {
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  return dequantize(w, values, nullptr, w.n, bf16);
}

at::Tensor dequantize_rows(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                           const at::Tensor& multipliers,
                           int64_t bits, int64_t group, int64_t zero, int64_t out_features, const at::Tensor& ids,
                           bool bf16) {
  const Weights w(values, scales, offsets, multipliers, bits, group, zero, out_features);
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < w.n, "row ", row[r], " is outside the weight's ", w.n, " rows");
  return dequantize(w, values, row, rows.numel(), bf16);
}
