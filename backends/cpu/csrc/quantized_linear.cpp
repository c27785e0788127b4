// Linear layers over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and on-the-fly int8/q4_0),
// for the few rows of a decode step: each column's quantized weights are streamed once per call and dotted against
// every row while they are in cache. Batch-1 decode is bound by the bytes of weights read, so fewer bits per weight
// is the only way to make it faster.
//
// One repacked layout serves every format: each weight is w = scale * u + offset, u an unsigned 4-bit or 8-bit
// value, with a float32 scale and offset per group of 16 or 32 inputs of a column (lossless for all six formats).
// 4-bit values pack a chunk of 32 inputs in 16 bytes, byte i holding input i (low nibble) and input i + 16 (high).
//
// Two ways to take the dot products:
// - int8: activations quantized per 32 inputs to int8 (as llama.cpp's Q8 activations), then integer dot products
//   (AVX512_VNNI vpdpbusd, AVX2 vpmaddubsw), scaled per chunk; the offsets' term uses the exact float sums.
// - float: each column dequantized to float32 once per call, then float32 dot products (what dequantize + matmul
//   computes, to float32's rounding): the exact path, for float32 models.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "quantized_weights.h"
#include "utils.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_QUANT_SIMD 1
#else
#define PAGEDLLM_QUANT_SIMD 0
#endif

namespace {

using pagedllm::kChunk;
using Weights = pagedllm::QuantizedWeights;
constexpr int kRows = 4;  // rows dotted against one unpacked chunk

// Chunk j of a column's values, one byte per input.
inline void unpack_chunk_bytes(const Weights& w, const uint8_t* column, int64_t j, uint8_t* out) {
  if (w.bits == 8) {
    std::copy(column + j * kChunk, column + (j + 1) * kChunk, out);
    return;
  }
  const uint8_t* packed = column + j * (kChunk / 2);
  for (int64_t i = 0; i < kChunk / 2; ++i) {
    out[i] = packed[i] & 0x0F;
    out[i + kChunk / 2] = packed[i] >> 4;
  }
}

// Column n as float32, w = scale * u + offset.
void dequantize_column(const Weights& w, int64_t n, float* out) {
  const uint8_t* column = w.values + n * w.row_bytes();
  const float* scales = w.scales + n * w.groups;
  const float* offsets = w.offsets + n * w.groups;
  alignas(64) uint8_t u[kChunk];
  for (int64_t j = 0; j < w.k / kChunk; ++j) {
    unpack_chunk_bytes(w, column, j, u);
    for (int64_t e = 0; e < kChunk; ++e) {
      const int64_t g = (j * kChunk + e) / w.group;
      out[j * kChunk + e] = u[e] * scales[g] + offsets[g];
    }
  }
}

float dot(const float* a, const float* b, int64_t k) {
#if defined(PAGEDLLM_VEC)
  pagedllm::Vec acc0 = pagedllm::Vec::zero(), acc1 = pagedllm::Vec::zero();
  int64_t i = 0;
  for (; i + 2 * pagedllm::Vec::size <= k; i += 2 * pagedllm::Vec::size) {
    acc0 = pagedllm::Vec::fma(pagedllm::Vec::load(a + i), pagedllm::Vec::load(b + i), acc0);
    acc1 = pagedllm::Vec::fma(pagedllm::Vec::load(a + i + pagedllm::Vec::size),
                              pagedllm::Vec::load(b + i + pagedllm::Vec::size), acc1);
  }
  float sum = (acc0 + acc1).sum();
#else
  float sum = 0.f;
  int64_t i = 0;
#endif
  for (; i < k; ++i) sum += a[i] * b[i];
  return sum;
}

// The rows as float32 [m, k] (bf16 widened), contiguous.
at::Tensor float_rows(const at::Tensor& rows) {
  return rows.scalar_type() == at::kFloat ? rows.contiguous() : rows.to(at::kFloat).contiguous();
}

// Activations for the int8 path: per row and chunk of 32 inputs, int8 values q and a scale d with x ~ d * q
// (d = max |x| / 127), and the exact float sum of x over each weight group (the offsets' term).
struct Int8Activations {
  std::vector<int8_t> q;
  std::vector<float> scale, group_sum;
  int64_t chunks, groups;

  Int8Activations(const float* x, int64_t m, int64_t k, int64_t group)
      : q(m * k), scale(m * (k / kChunk)), group_sum(m * (k / group)), chunks(k / kChunk), groups(k / group) {
    at::parallel_for(0, m * chunks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const float* src = x + c * kChunk;  // rows are contiguous: chunk c of all rows' chunks
        float amax = 0.f;
        for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(src[i]));
        const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
        scale[c] = d;
        for (int64_t i = 0; i < kChunk; ++i) q[c * kChunk + i] = static_cast<int8_t>(std::nearbyint(src[i] * inverse));
        for (int64_t part = 0; part < kChunk / group; ++part) {
          float sum = 0.f;
          for (int64_t i = part * group; i < (part + 1) * group; ++i) sum += src[i];
          group_sum[c * (kChunk / group) + part] = sum;
        }
      }
    });
  }
};

float offsets_term(const Weights& w, int64_t n, const float* group_sum) {
  return dot(w.offsets + n * w.groups, group_sum, w.groups);
}

#if PAGEDLLM_QUANT_SIMD
// The int8 path, one chunk per 256-bit register: AVX512_VNNI's vpdpbusd where the build has it, else AVX2.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Chunk j's 32 values as bytes: the low nibbles are inputs 0-15, the high ones 16-31.
inline __m256i load_chunk(const Weights& w, const uint8_t* column, int64_t j) {
  if (w.bits == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + j * kChunk));
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + j * (kChunk / 2)));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

// The weight scale of each 32-bit lane of a chunk's dot product (lane l sums inputs 4l..4l+3).
inline __m256 chunk_scales(const Weights& w, const float* scales, int64_t j) {
  if (w.group == kChunk) return _mm256_set1_ps(scales[j]);
  return _mm256_set_m128(_mm_set1_ps(scales[2 * j + 1]), _mm_set1_ps(scales[2 * j]));
}

// Integer dot products of a chunk's unsigned values u with int8 activations a, per 32-bit lane. Without VNNI,
// vpmaddubsw saturates its pair sums at 16 bits: 8-bit values go in as s = u - 128 (|s| <= 128, |a| <= 127), signed
// through |s| and a * sign(s), and 128 * sum(a) is added back.
struct ChunkDot {
  __m256i u, magnitude;
  bool eight_bits;
  ChunkDot(__m256i values, bool eight) : u(values), eight_bits(eight) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    eight_bits = false;  // vpdpbusd sums in 32 bits: unsigned 8-bit values go in as they are
#endif
    if (eight_bits) {
      u = _mm256_xor_si256(values, _mm256_set1_epi8(static_cast<char>(0x80)));
      magnitude = _mm256_abs_epi8(u);
    }
  }
  __m256i with(__m256i a) const {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    if (!eight_bits) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), ones);
    const __m256i signed_dot = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, u)), ones);
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), a), ones);
    return _mm256_add_epi32(signed_dot, _mm256_slli_epi32(sums, 7));
  }
};

// Two accumulators per row, for even and odd chunks: one chain of dependent FMAs would bound a row to a chunk per
// FMA latency.
template <int R>
struct Int8Rows {
  static void run(const Weights& w, int64_t n, const Int8Activations& act, int64_t r0, float* result) {
    const uint8_t* column = w.values + n * w.row_bytes();
    const float* scales = w.scales + n * w.groups;
    __m256 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    const auto step = [&](int64_t j, __m256* sums) {
      const ChunkDot chunk(load_chunk(w, column, j), w.bits == 8);
      const __m256 ws = chunk_scales(w, scales, j);
      for (int r = 0; r < R; ++r) {
        const int64_t c = (r0 + r) * act.chunks + j;
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act.q.data() + c * kChunk));
        sums[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chunk.with(a)), _mm256_mul_ps(ws, _mm256_set1_ps(act.scale[c])),
                                  sums[r]);
      }
    };
    int64_t j = 0;
    for (; j + 1 < act.chunks; j += 2) {
      step(j, even);
      step(j + 1, odd);
    }
    if (j < act.chunks) step(j, even);
    for (int r = 0; r < R; ++r)
      result[r] = hsum(_mm256_add_ps(even[r], odd[r])) +
                  offsets_term(w, n, act.group_sum.data() + (r0 + r) * act.groups);
  }
};

#endif

#if PAGEDLLM_QUANT_SIMD
// The float path, one vector of inputs at a time (16 with AVX-512, 8 with AVX2).
using pagedllm::Vec;
constexpr int kParts = kChunk / Vec::size;

// Inputs part * Vec::size onwards of chunk j as float32 values u.
inline Vec chunk_part(const Weights& w, const uint8_t* column, int64_t j, int part) {
  const int64_t first = part * Vec::size;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const uint8_t* bytes = w.bits == 8 ? column + j * kChunk + first : column + j * (kChunk / 2) + first % 16;
  __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  if (w.bits == 4) u = _mm512_and_si512(_mm512_srli_epi32(u, first < 16 ? 0 : 4), _mm512_set1_epi32(0x0F));
  return {_mm512_cvtepi32_ps(u)};
#else
  const uint8_t* bytes = w.bits == 8 ? column + j * kChunk + first : column + j * (kChunk / 2) + first % 16;
  __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  if (w.bits == 4) u = _mm256_and_si256(_mm256_srli_epi32(u, first < 16 ? 0 : 4), _mm256_set1_epi32(0x0F));
  return {_mm256_cvtepi32_ps(u)};
#endif
}

// Inputs part * Vec::size onwards of chunk j of column n, dequantized.
inline Vec weight_part(const Weights& w, int64_t n, const uint8_t* column, int64_t j, int part) {
  const int64_t g = n * w.groups + (j * kChunk + part * Vec::size) / w.group;
  return Vec::fma(chunk_part(w, column, j, part), Vec::broadcast(w.scales[g]), Vec::broadcast(w.offsets[g]));
}

void dequantize_column_simd(const Weights& w, int64_t n, float* out) {
  const uint8_t* column = w.values + n * w.row_bytes();
  for (int64_t j = 0; j < w.k / kChunk; ++j)
    for (int part = 0; part < kParts; ++part)
      weight_part(w, n, column, j, part).store(out + j * kChunk + part * Vec::size);
}

template <int R>
struct FloatRows {
  static void run(const Weights& w, int64_t n, const float* x, int64_t r0, float* result) {
    const uint8_t* column = w.values + n * w.row_bytes();
    Vec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = Vec::zero();
    for (int64_t j = 0; j < w.k / kChunk; ++j)
      for (int part = 0; part < kParts; ++part) {
        const Vec weight = weight_part(w, n, column, j, part);
        for (int r = 0; r < R; ++r)
          acc[r] = Vec::fma(weight, Vec::load(x + (r0 + r) * w.k + j * kChunk + part * Vec::size), acc[r]);
      }
    for (int r = 0; r < R; ++r) result[r] = acc[r].sum();
  }
};
#endif

#if PAGEDLLM_QUANT_SIMD
// Kernel<rows>::run(args...) for 1 to kRows rows: the row count is a template argument, so that the accumulators
// stay in registers.
template <template <int> class Kernel, typename... Args>
inline void with_rows(int64_t rows, const Args&... args) {
  static_assert(kRows == 4, "one case per row count");
  switch (rows) {
    case 4: return Kernel<4>::run(args...);
    case 3: return Kernel<3>::run(args...);
    case 2: return Kernel<2>::run(args...);
    default: return Kernel<1>::run(args...);
  }
}
#endif

// Rows r0..r0+rows-1 of column n through the int8 path.
void int8_column(const Weights& w, int64_t n, const Int8Activations& act, int64_t r0, int64_t rows, float* result) {
#if PAGEDLLM_QUANT_SIMD
  with_rows<Int8Rows>(rows, w, n, act, r0, result);
#else
  const uint8_t* column = w.values + n * w.row_bytes();
  const float* scales = w.scales + n * w.groups;
  alignas(64) uint8_t u[kChunk];
  for (int64_t r = 0; r < rows; ++r) result[r] = 0.f;
  for (int64_t j = 0; j < act.chunks; ++j) {
    unpack_chunk_bytes(w, column, j, u);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = (r0 + r) * act.chunks + j;
      const int8_t* a = act.q.data() + c * kChunk;
      for (int64_t i = 0; i < kChunk; i += w.group) {
        int32_t sum = 0;
        for (int64_t e = i; e < i + w.group; ++e) sum += static_cast<int32_t>(u[e]) * a[e];
        result[r] += static_cast<float>(sum) * (scales[(j * kChunk + i) / w.group] * act.scale[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) result[r] += offsets_term(w, n, act.group_sum.data() + (r0 + r) * act.groups);
#endif
}

// Rows r0..r0+rows-1 of column n through the float path (`column` is scratch for K floats).
void float_column(const Weights& w, int64_t n, const float* x, int64_t r0, int64_t rows, float* result,
                  float* column) {
#if PAGEDLLM_QUANT_SIMD
  (void)column;
  with_rows<FloatRows>(rows, w, n, x, r0, result);
#else
  dequantize_column(w, n, column);
  for (int64_t r = 0; r < rows; ++r) result[r] = dot(x + (r0 + r) * w.k, column, w.k);
#endif
}

void dequantize_any(const Weights& w, int64_t n, float* out) {
#if PAGEDLLM_QUANT_SIMD
  dequantize_column_simd(w, n, out);
#else
  dequantize_column(w, n, out);
#endif
}

void store(const float* result, int64_t rows, int64_t n, int64_t out_features, const float* bias, void* out,
           bool float_output, int64_t r0) {
  for (int64_t r = 0; r < rows; ++r) {
    const float v = result[r] + (bias != nullptr ? bias[n] : 0.f);
    const int64_t at = (r0 + r) * out_features + n;
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
                            const at::Tensor& offsets, int64_t bits, int64_t group,
                            const c10::optional<at::Tensor>& bias, bool float_output, bool int8_activations) {
  const Weights w(values, scales, offsets, bits, group);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bf16 input");
  TORCH_CHECK(x.size(-1) == w.k, "input width ", x.size(-1), " does not match the weight's ", w.k);
  const int64_t n = values.size(0);
  const at::Tensor rows = float_rows(x.reshape({-1, w.k}));
  const int64_t m = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const bool as_float = float_output || x.scalar_type() == at::kFloat;
  at::Tensor out = x.new_empty(shape, x.options().dtype(as_float ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) bias_float = bias->to(at::kFloat).contiguous();
  const float* bias_ptr = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  const float* xs = rows.data_ptr<float>();
  void* y = out.data_ptr();
  std::unique_ptr<Int8Activations> act;
  if (int8_activations) act = std::make_unique<Int8Activations>(xs, m, w.k, w.group);
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> column(int8_activations ? 0 : w.k);
    float result[kRows];
    for (int64_t c = begin; c < end; ++c)
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t count = std::min<int64_t>(kRows, m - r0);
        if (int8_activations)
          int8_column(w, c, *act, r0, count, result);
        else
          float_column(w, c, xs, r0, count, result, column.data());
        store(result, count, c, n, bias_ptr, y, as_float, r0);
      }
  });
  return out;
}

// The whole weight as [N, K] float32 or bf16 (prefill and large batches run it through the dense GEMMs).
at::Tensor dequantize_weight(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                             int64_t bits, int64_t group, bool bf16) {
  const Weights w(values, scales, offsets, bits, group);
  const int64_t n = values.size(0);
  at::Tensor out = values.new_empty({n, w.k}, values.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> column(bf16 ? w.k : 0);
    for (int64_t c = begin; c < end; ++c) {
      if (!bf16) {
        dequantize_any(w, c, out.data_ptr<float>() + c * w.k);
        continue;
      }
      dequantize_any(w, c, column.data());
      at::BFloat16* dst = out.data_ptr<at::BFloat16>() + c * w.k;
#if defined(PAGEDLLM_VEC)
      for (int64_t i = 0; i < w.k; i += pagedllm::Vec::size) pagedllm::Vec::load(column.data() + i).store(dst + i);
#else
      for (int64_t i = 0; i < w.k; ++i) dst[i] = at::BFloat16(column[i]);
#endif
    }
  });
  return out;
}
