// Linear layers over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and on-the-fly int8/q4_0),
// for the few rows of a decode step: each panel of 16 columns (quantized_weights.h) is streamed once per call and
// summed against every row while it is in cache, 16 columns per vector. Batch-1 decode is bound by the bytes of
// weights read, so fewer bits per weight is the only way to make it faster.
//
// Two ways to take the dot products:
// - int8: activations quantized per 32 inputs to int8 (as llama.cpp's Q8 activations), then integer dot products
//   (AVX512_VNNI vpdpbusd, else vpmaddubsw), scaled per group; the offsets' term uses the exact float sums.
// - float: the values converted to float32 in registers, float32 products with the activations, scaled per group
//   (what dequantize + matmul computes, to float32's rounding): the exact path, for float32 models.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "quantized_lanes.h"

namespace {

using pagedllm::kChunk;
using pagedllm::kLoadBytes;
using pagedllm::kPanel;
using pagedllm::kPrefetchLoads;
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

// Per row and group of `group` inputs, the float32 sum of the row's inputs (the offsets' term of both paths).
std::vector<float> row_group_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * (k / group));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / group; ++g) {
      float total = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) total += x[r * k + i];
      sums[r * (k / group) + g] = total;
    }
  return sums;
}

// Activations for the int8 path: per row and chunk of 32 inputs, int8 values q and a scale d with x ~ d * q
// (d = max |x| / 127), q stored in the weight's int8 order (kInt8Order4/8), and the exact float sum of x over each
// weight group (the offsets' term).
struct Int8Activations {
  std::vector<int8_t> q;
  std::vector<float> scale, group_sum;
  int64_t chunks, groups;

  Int8Activations(const float* x, int64_t m, int64_t k, int64_t group, int64_t bits)
      : q(m * k), scale(m * (k / kChunk)), group_sum(row_group_sums(x, m, k, group)), chunks(k / kChunk),
        groups(k / group) {
    const int* order = bits == 4 ? pagedllm::kInt8Order4 : pagedllm::kInt8Order8;
    at::parallel_for(0, m * chunks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const float* src = x + c * kChunk;  // rows are contiguous: chunk c of all rows' chunks
        float amax = 0.f;
        for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(src[i]));
        const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        scale[c] = d;
        for (int64_t i = 0; i < kChunk; ++i)
          q[c * kChunk + i] = static_cast<int8_t>(std::nearbyint(src[i / 8 * 8 + order[i % 8]] * inverse));
      }
    });
  }
};

// Sums of panel p for rows r0.. (16 per row, one per column), through the scalar code.
void int8_panel_scalar(const Weights& w, int64_t p, const Int8Activations& act, int64_t r0, int64_t rows,
                       float* sums) {
  const int* order = w.bits == 4 ? pagedllm::kInt8Order4 : pagedllm::kInt8Order8;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        int32_t dot = 0;  // over the group's activation bytes, in their order
        for (int64_t t = g * w.group; t < (g + 1) * w.group; ++t)
          dot += w.u(p, c, t / 8 * 8 + order[t % 8]) * act.q[(r0 + r) * w.k + t];
        const float d = act.scale[(r0 + r) * act.chunks + g * w.group / kChunk];
        total += static_cast<float>(dot) * (w.scale(p, g, c) * d) +
                 w.offset(p, g, c) * act.group_sum[(r0 + r) * act.groups + g];
      }
      sums[r * kPanel + c] = total;
    }
}

void float_panel_scalar(const Weights& w, int64_t p, const float* x, int64_t r0, int64_t rows, float* sums) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float total = 0.f;
      for (int64_t i = 0; i < w.k; ++i) {
        const int64_t g = i / w.group;
        total += std::fma(w.u(p, c, i), w.scale(p, g, c), w.offset(p, g, c)) * x[(r0 + r) * w.k + i];
      }
      sums[r * kPanel + c] = total;
    }
}

#if PAGEDLLM_QUANT_SIMD
// The int8 path over panel p for rows r0 .. r0 + R - 1: per group, integer sums of each load's bytes with the
// rows' int8 activations, then scaled by the column's scale and the chunk's activation scale, plus the offsets'
// term. `sums` gets [R][16].
template <int R, int Bits>
void int8_panel(const Weights& w, int64_t p, const Int8Activations& act, int64_t r0, float* sums) {
  const uint8_t* panel = w.panel(p);
  const int64_t per_load = Bits == 4 ? 8 : 4, loads = w.group / per_load;
  const int32_t* a[R];
  for (int r = 0; r < R; ++r) a[r] = reinterpret_cast<const int32_t*>(act.q.data() + (r0 + r) * w.k);
  const Lanes::I mask = Lanes::set1(0x0F0F0F0F);
  for (int h = 0; h < Lanes::halves; ++h) {
    Lanes::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Lanes::zerof();
    for (int64_t g = 0; g < w.groups; ++g) {
      Lanes::I dot[R];
      for (int r = 0; r < R; ++r) dot[r] = Lanes::zeroi();
      for (int64_t l = g * loads; l < (g + 1) * loads; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (l + kPrefetchLoads) * kLoadBytes), _MM_HINT_T0);
        const Lanes::I v = Lanes::load(panel + l * kLoadBytes + h * kLanes * 4);
        if (Bits == 4) {
          const Lanes::I low = Lanes::band(v, mask), high = Lanes::band(Lanes::shr(v, 4), mask);
          for (int r = 0; r < R; ++r) {
            dot[r] = Lanes::dot4(dot[r], low, Lanes::set1(a[r][2 * l]));
            dot[r] = Lanes::dot4(dot[r], high, Lanes::set1(a[r][2 * l + 1]));
          }
        } else {
          for (int r = 0; r < R; ++r) dot[r] = Lanes::dot8(dot[r], v, Lanes::set1(a[r][l]));
        }
      }
      const Lanes::F scale = group_lanes(w, w.scales, p, g, h), offset = offset_lanes(w, scale, p, g, h);
      const int64_t chunk = g * w.group / kChunk;
      for (int r = 0; r < R; ++r) {
        const Lanes::F d = Lanes::set1f(act.scale[(r0 + r) * act.chunks + chunk]);
        acc[r] = Lanes::fma(Lanes::cvt(dot[r]), Lanes::mul(scale, d), acc[r]);
        acc[r] = Lanes::fma(offset, Lanes::set1f(act.group_sum[(r0 + r) * act.groups + g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) Lanes::store(sums + r * kPanel + h * kLanes, acc[r]);
  }
}

// The float path over panel p: per group, the rows' inputs times the values u (converted to float32 in registers,
// 16 columns at a time), then scaled: sum(w x) = scale * sum(u x) + offset * sum(x), with the group's sums of x
// taken once per call (group_sum [m][groups]). Scaling per group, not per weight, leaves three vector operations
// and the product per 8 weights: this path is bound by them, not by reading the weights. Each row sums into C
// independent accumulators (inputs alternating): one chain of dependent multiply-adds would wait on the FMA's
// latency at every input.
template <int R, int Bits>
void float_panel(const Weights& w, int64_t p, const float* x, const float* group_sum, int64_t r0, float* sums) {
  constexpr int C = R == 1 ? 4 : 2;
  const uint8_t* panel = w.panel(p);
  const int64_t per_load = Bits == 4 ? 8 : 4, loads = w.group / per_load;
  const Lanes::I mask = Lanes::set1(Bits == 4 ? 0x0F : 0xFF);
  for (int h = 0; h < Lanes::halves; ++h) {
    Lanes::F acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Lanes::zerof();
    for (int64_t g = 0; g < w.groups; ++g) {
      Lanes::F dot[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dot[r][c] = Lanes::zerof();
      for (int64_t l = g * loads; l < (g + 1) * loads; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(panel + (l + kPrefetchLoads) * kLoadBytes), _MM_HINT_T0);
        const Lanes::I v = Lanes::load(panel + l * kLoadBytes + h * kLanes * 4);
        for (int e = 0; e < per_load; ++e) {
          const Lanes::F u = Lanes::cvt(Lanes::band(Lanes::shr(v, Bits * e), mask));
          const int64_t i = l * per_load + (Bits == 4 ? pagedllm::kInputOfNibble[e] : pagedllm::kInputOfByte[e]);
          for (int r = 0; r < R; ++r)
            dot[r][e % C] = Lanes::fma(u, Lanes::set1f(x[(r0 + r) * w.k + i]), dot[r][e % C]);
        }
      }
      const Lanes::F scale = group_lanes(w, w.scales, p, g, h), offset = offset_lanes(w, scale, p, g, h);
      for (int r = 0; r < R; ++r) {
        Lanes::F total = dot[r][0];
        for (int c = 1; c < C; ++c) total = Lanes::add(total, dot[r][c]);
        acc[r] = Lanes::fma(total, scale, acc[r]);
        acc[r] = Lanes::fma(offset, Lanes::set1f(group_sum[(r0 + r) * w.groups + g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) Lanes::store(sums + r * kPanel + h * kLanes, acc[r]);
  }
}

// Kernel<rows, bits>::run(args...) for 1 to kRows rows: the row count is a template argument, so that the
// accumulators stay in registers.
template <int Bits, typename Run>
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

// Sums [rows][16] of panel p for rows r0.. through the int8 path.
void int8_sums(const Weights& w, int64_t p, const Int8Activations& act, int64_t r0, int64_t rows, float* sums) {
#if PAGEDLLM_QUANT_SIMD
  with_rows<0>(rows, [&](auto r) {
    if (w.bits == 4)
      int8_panel<decltype(r)::value, 4>(w, p, act, r0, sums);
    else
      int8_panel<decltype(r)::value, 8>(w, p, act, r0, sums);
  });
#else
  int8_panel_scalar(w, p, act, r0, rows, sums);
#endif
}

void float_sums(const Weights& w, int64_t p, const float* x, const float* group_sum, int64_t r0, int64_t rows,
                float* sums) {
#if PAGEDLLM_QUANT_SIMD
  with_rows<0>(rows, [&](auto r) {
    if (w.bits == 4)
      float_panel<decltype(r)::value, 4>(w, p, x, group_sum, r0, sums);
    else
      float_panel<decltype(r)::value, 8>(w, p, x, group_sum, r0, sums);
  });
#else
  float_panel_scalar(w, p, x, r0, rows, sums);
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
// [..., N] in x's dtype, or float32 when `float_output`. `int8_activations` picks the int8 path.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t bits, int64_t group, int64_t zero,
                            int64_t out_features,
                            const c10::optional<at::Tensor>& bias, bool float_output, bool int8_activations) {
  const Weights w(values, scales, offsets, bits, group, zero, out_features);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bf16 input");
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
  std::unique_ptr<Int8Activations> act;
  std::vector<float> group_sum;
  if (int8_activations)
    act = std::make_unique<Int8Activations>(xs, m, w.k, w.group, w.bits);
  else
    group_sum = row_group_sums(xs, m, w.k, w.group);
  at::parallel_for(0, w.panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel];
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t count = std::min<int64_t>(kRows, m - r0);
        if (int8_activations)
          int8_sums(w, p, *act, r0, count, sums);
        else
          float_sums(w, p, xs, group_sum.data(), r0, count, sums);
        store(sums, count, p, w, bias_ptr, y, as_float, r0);
      }
  });
  return out;
}

// The whole weight as [N, K] float32 or bf16 (prefill and large batches of float32 models run it through the dense
// GEMMs).
namespace {

// Column c of panel p (output row p * 16 + c of the weight) dequantized into dst[0, k), float32 or bf16.
template <typename T>
void dequantize_column(const Weights& w, int64_t p, int64_t c, T* dst) {
  const int* input = w.bits == 4 ? pagedllm::kInputOfNibble : pagedllm::kInputOfByte;
  const uint32_t mask = w.bits == 4 ? 0x0F : 0xFF;
  const int64_t per_load = w.inputs_per_load();
  for (int64_t l = 0; l < w.k / per_load; ++l) {
    const int64_t g = l * per_load / w.group;
    const float scale = w.scale(p, g, c), offset = w.offset(p, g, c);
    const uint8_t* lane = w.panel(p) + l * kLoadBytes + c * 4;
    const uint32_t word = lane[0] | (lane[1] << 8) | (lane[2] << 16) | (static_cast<uint32_t>(lane[3]) << 24);
    for (int64_t e = 0; e < per_load; ++e)
      dst[l * per_load + input[e]] = static_cast<T>(std::fma(static_cast<float>((word >> (w.bits * e)) & mask),
                                                             scale, offset));
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
                             int64_t bits, int64_t group, int64_t zero, int64_t out_features, bool bf16) {
  const Weights w(values, scales, offsets, bits, group, zero, out_features);
  return dequantize(w, values, nullptr, w.n, bf16);
}

at::Tensor dequantize_rows(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                           int64_t bits, int64_t group, int64_t zero, int64_t out_features, const at::Tensor& ids,
                           bool bf16) {
  const Weights w(values, scales, offsets, bits, group, zero, out_features);
  const at::Tensor rows = ids.to(at::kLong).contiguous();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows.numel(); ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < w.n, "row ", row[r], " is outside the weight's ", w.n, " rows");
  return dequantize(w, values, row, rows.numel(), bf16);
}
