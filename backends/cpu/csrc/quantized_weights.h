// A view of a block-quantized weight in the one layout every quantized kernel reads: w = scale * u + offset, u an
// unsigned 4-bit, 5-bit, 6-bit or 8-bit value, a float32 scale and offset per group of 16 or 32 inputs of an output
// column.
//
// Columns are stored in panels of 16, side by side: one 64-byte load holds the same few inputs of all 16 columns, a
// column per 32-bit lane, so that a kernel sums 16 columns at once, with no horizontal sums or transpositions, and
// reads each weight once per call. Inside a lane:
// - 4 bits: 8 inputs i..i+7 (i a multiple of 8). Nibble k (bits 4k..4k+3) holds input i + 2k for k < 4 and input
//   i + 2(k - 4) + 1 for k >= 4, so a shift by 4k and the mask 0x000F000F leave inputs i + 2k and i + 2k + 1 as a
//   pair of 16-bit halves (a bf16 pair), and the mask 0x0F0F0F0F leaves the bytes of inputs i, i+4, i+1, i+5 (and of
//   i+2, i+6, i+3, i+7 after a shift by 4: int8 dot products with activations in that order, kInt8Order4).
// - 8 bits: 4 inputs i..i+3, byte b holding input i + {0, 2, 1, 3}[b]: a shift by 0 or 8 and the mask 0x00FF00FF
//   leave the pairs (i, i+1) and (i+2, i+3).
// - 5 bits (Q5_K) and 6 bits (Q6_K): per unit of 32 or 16 inputs, their low nibbles as four or two loads of the
//   4-bit layout (loads j of the unit), then a load of 32-bit words holding the high bit or 2 bits of all of them,
//   nibble k of load j at bit high_bit(bits, j, k): the fields of a lane's bytes' nibbles are 8 bits apart, and those
//   of a bf16 pair 16 bits apart, so that, as for the nibbles, one shift and one mask put either beside the low bits
//   (u = low + 16 * high).
// Scales and offsets are [panels][groups][16], float32, or float16 where every one of them is exact in it (GGUF's
// Q4_0, Q4_1 and Q8_0 keep theirs in float16): fewer bytes per weight for the bandwidth-bound decode. K-quants keep
// them as the file does, factored: int8 factors per group times a float32 multiplier per column and super-block of
// 256 inputs (`multipliers`, [panels][supers][2][16]: the scales' multiplier, then the offsets'), whose products are
// the same floats. A symmetric
// format (Q4_0, Q8_0, Q6_K, int8) stores no offsets: each is -zero * scale, for its integer zero point. A weight
// whose columns do not fill its last panel is padded with zero columns.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <xmmintrin.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace pagedllm {

constexpr int64_t kChunk = 32;       // inputs per activation scale of the int8 path
constexpr int64_t kPanel = 16;       // columns per panel
constexpr int64_t kLoadBytes = 64;   // one load: kPanel lanes of 32 bits
constexpr int64_t kSuper = 256;      // inputs per multiplier of factored scales (a K-quant's super-block)
// Loads ahead that the streaming kernels prefetch: one core's few outstanding misses, not the hardware prefetcher,
// bound a stream's rate otherwise (docs/quantization.md).
constexpr int64_t kPrefetchLoads = 32;
// Which of a lane's 8 inputs each nibble holds (4 bits), and the other way round; which of its 4 inputs each byte
// holds (8 bits: its own inverse).
constexpr int kInputOfNibble[8] = {0, 2, 4, 6, 1, 3, 5, 7};
constexpr int kNibbleOfInput[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int kInputOfByte[4] = {0, 2, 1, 3};
// Input order of the int8 path's activation bytes, per 8 inputs, for each width of weights.
constexpr int kInt8Order4[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int kInt8Order8[8] = {0, 2, 1, 3, 4, 6, 5, 7};
// 5 and 6 bits: the loads of low nibbles per unit, and the first of the high bits of nibble k of load j of the unit
// in its lane's word of them.
constexpr int unit_loads(int64_t bits) { return bits == 5 ? 4 : 2; }
constexpr int high_bit(int64_t bits, int j, int k) {
  return 8 * (k / 2) + (bits == 5 ? 2 * j + k % 2 : 4 * (1 - j) + 2 * (k % 2));
}
constexpr bool has_high_bits(int64_t bits) { return bits == 5 || bits == 6; }
// 5 and 6 bits: the high bits of nibble k of load l from their lane's 32-bit word.
constexpr uint32_t high_part(int64_t bits, uint32_t word, int64_t l, int k) {
  return (word >> high_bit(bits, static_cast<int>(l % unit_loads(bits)), k)) & ((1u << (bits - 4)) - 1);
}

// f(std::integral_constant<int, bits>{}): the kernels are compiled per width of values.
template <typename F>
inline void with_bits(int64_t bits, const F& f) {
  switch (bits) {
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// The kernels' per-load bodies are inlined whatever their size: called out of line, they would read and write the
// accumulators they share through memory.
#define PAGEDLLM_INLINE __attribute__((always_inline))

template <typename F, int... J>
PAGEDLLM_INLINE inline void loads_of_units(int64_t begin, int64_t end, const F& f, std::integer_sequence<int, J...>) {
  for (int64_t l = begin; l < end; l += sizeof...(J)) (f(l + J, std::integral_constant<int, J>{}), ...);
}
// f(l, j) for loads begin..end of Bits-bit values, j (a compile-time constant) the load's place in its unit (0
// without high bits), so that kernels compiled per width fold where its high bits lie.
template <int Bits, typename F>
PAGEDLLM_INLINE inline void for_each_load(int64_t begin, int64_t end, const F& f) {
  loads_of_units(begin, end, f, std::make_integer_sequence<int, has_high_bits(Bits) ? unit_loads(Bits) : 1>{});
}

struct QuantizedWeights {
  const uint8_t* values;
  const void* scales;
  const void* offsets;
  const float* multipliers;  // null unless the scales and offsets are int8 factors
  bool half;  // scales and offsets in float16
  int64_t element;  // bytes per scale or offset: 1 (factors), 2 or 4
  int64_t bits, group, zero, k, n, panels, groups;  // zero > 0: offsets are -zero * scale, not stored

  QuantizedWeights(const at::Tensor& v, const at::Tensor& s, const at::Tensor& o, const at::Tensor& m, int64_t bits_,
                   int64_t group_, int64_t zero_, int64_t n_)
      : bits(bits_), group(group_), zero(zero_), n(n_) {
    TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "4-bit, 5-bit, 6-bit or 8-bit values, got ", bits);
    TORCH_CHECK(group == 16 || group == 32, "groups of 16 or 32 inputs, got ", group);
    TORCH_CHECK(bits != 5 || group == 32, "5-bit values come in groups of 32 inputs (a unit of their high bits)");
    TORCH_CHECK(v.dim() == 2 && v.scalar_type() == at::kByte && v.is_contiguous(), "values: contiguous uint8 [P, *]");
    half = s.scalar_type() == at::kHalf;
    const bool factored = m.numel() > 0;
    element = factored ? 1 : half ? 2 : 4;
    TORCH_CHECK(s.dim() == 3 && s.scalar_type() == (factored ? at::kChar : half ? at::kHalf : at::kFloat) &&
                    s.is_contiguous() && s.size(0) == v.size(0) && s.size(2) == kPanel,
                "scales: contiguous float32 or float16 [panels, groups, 16], or int8 factors with multipliers");
    TORCH_CHECK(zero >= 0 && zero < (1 << bits), "a zero point of ", zero, " for ", bits, "-bit values");
    TORCH_CHECK(zero > 0 || (o.scalar_type() == s.scalar_type() && o.is_contiguous() && o.sizes() == s.sizes()),
                "offsets: as the scales (or a zero point instead)");
    panels = v.size(0);
    k = v.size(1) * 8 / bits / kPanel;
    groups = s.size(1);
    TORCH_CHECK(k % kChunk == 0 && groups * group == k, "the input width ", k, " must be whole chunks of 32 and ",
                "match the scales' ", groups, " groups of ", group);
    TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, n, " columns do not fill ", panels, " panels");
    TORCH_CHECK(!factored || (m.scalar_type() == at::kFloat && m.is_contiguous() && k % kSuper == 0 &&
                              m.sizes() == at::IntArrayRef({panels, k / kSuper, 2, kPanel})),
                "multipliers: contiguous float32 [panels, k / 256, 2, 16]");
    values = v.data_ptr<uint8_t>();
    scales = s.data_ptr();
    offsets = zero > 0 ? nullptr : o.data_ptr();
    multipliers = factored ? m.data_ptr<float>() : nullptr;
  }
  int64_t panel_bytes() const { return k * kPanel * bits / 8; }
  const uint8_t* panel(int64_t p) const { return values + p * panel_bytes(); }
  // where the 16 scales or offsets of panel p, group g start
  const void* of_group(const void* table, int64_t p, int64_t g) const {
    return static_cast<const char*>(table) + (p * groups + g) * kPanel * element;
  }
  // factored: where the 16 multipliers of those scales or offsets start
  const float* multiplier_of(const void* table, int64_t p, int64_t g) const {
    return multipliers + ((p * (k / kSuper) + g * group / kSuper) * 2 + (table == offsets ? 1 : 0)) * kPanel;
  }
  // the scale or offset of column c there
  float at(const void* table, int64_t p, int64_t g, int64_t c) const {
    const void* first = of_group(table, p, g);
    if (multipliers != nullptr)
      return static_cast<float>(static_cast<const int8_t*>(first)[c]) * multiplier_of(table, p, g)[c];
    return half ? static_cast<float>(static_cast<const c10::Half*>(first)[c]) : static_cast<const float*>(first)[c];
  }
  float scale(int64_t p, int64_t g, int64_t c) const { return at(scales, p, g, c); }
  float offset(int64_t p, int64_t g, int64_t c) const {
    return zero > 0 ? static_cast<float>(-zero) * scale(p, g, c) : at(offsets, p, g, c);
  }
  int64_t inputs_per_load() const { return bits == 8 ? 4 : 8; }
  // Where load l of a panel of `bits`-bit values starts (5 and 6 bits: each unit's loads of low nibbles are followed
  // by their high bits' load); static, so that kernels compiled per width fold it.
  static const uint8_t* load_at(const uint8_t* panel, int64_t bits, int64_t l) {
    if (!has_high_bits(bits)) return panel + l * kLoadBytes;
    const int64_t unit = unit_loads(bits);
    return panel + l / unit * (unit + 1) * kLoadBytes + l % unit * kLoadBytes;
  }
  // 5 and 6 bits: where the high bits of load l start.
  static const uint8_t* high_at(const uint8_t* panel, int64_t bits, int64_t l) {
    const int64_t unit = unit_loads(bits);
    return panel + l / unit * (unit + 1) * kLoadBytes + unit * kLoadBytes;
  }
  // The streaming kernels' prefetch, kPrefetchLoads loads ahead of load l (5 and 6 bits: of its high bits too, once
  // a unit).
  static void prefetch_ahead(const uint8_t* panel, int64_t bits, int64_t l) {
    _mm_prefetch(reinterpret_cast<const char*>(load_at(panel, bits, l) + kPrefetchLoads * kLoadBytes), _MM_HINT_T0);
    if (has_high_bits(bits) && l % unit_loads(bits) == unit_loads(bits) - 1)
      _mm_prefetch(reinterpret_cast<const char*>(high_at(panel, bits, l) + kPrefetchLoads * kLoadBytes), _MM_HINT_T0);
  }
  const uint8_t* load(int64_t p, int64_t l) const { return load_at(panel(p), bits, l); }
  const uint8_t* high_load(int64_t p, int64_t l) const { return high_at(panel(p), bits, l); }
  // u of column c of panel p at input i, read one at a time (the scalar path and tests).
  int u(int64_t p, int64_t c, int64_t i) const {
    const int64_t l = i / inputs_per_load();
    const uint8_t* lane = load(p, l) + c * 4;
    if (bits == 8) return lane[kInputOfByte[i % 4]];
    const int nibble = kNibbleOfInput[i % 8];
    const int low = (word(lane) >> (4 * nibble)) & 0x0F;
    if (bits == 4) return low;
    return low | high_part(bits, word(high_load(p, l) + c * 4), l, nibble) << 4;
  }
  static uint32_t word(const uint8_t* lane) {
    return lane[0] | (lane[1] << 8) | (lane[2] << 16) | (static_cast<uint32_t>(lane[3]) << 24);
  }
};

}  // namespace pagedllm
