// A view of a block-quantized weight in the one layout every quantized kernel reads: w = scale * u + offset, u an
// unsigned 4-bit or 8-bit value, a float32 scale and offset per group of 16 or 32 inputs of an output column. 4-bit
// values pack a chunk of 32 inputs in 16 bytes, byte i holding input i (low nibble) and input i + 16 (high).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagedllm {

constexpr int64_t kChunk = 32;  // inputs per packed chunk (and per activation scale of the int8 path)

struct QuantizedWeights {
  const uint8_t* values;
  const float* scales;
  const float* offsets;
  int64_t bits, group, k, groups;

  QuantizedWeights(const at::Tensor& v, const at::Tensor& s, const at::Tensor& o, int64_t bits_, int64_t group_)
      : bits(bits_), group(group_) {
    TORCH_CHECK(bits == 4 || bits == 8, "4-bit or 8-bit values, got ", bits);
    TORCH_CHECK(group == 16 || group == 32, "groups of 16 or 32 inputs, got ", group);
    TORCH_CHECK(v.dim() == 2 && v.scalar_type() == at::kByte && v.is_contiguous(), "values: contiguous uint8 [N, *]");
    TORCH_CHECK(s.scalar_type() == at::kFloat && o.scalar_type() == at::kFloat && s.is_contiguous() &&
                    o.is_contiguous() && s.sizes() == o.sizes() && s.size(0) == v.size(0),
                "scales and offsets: contiguous float32 [N, groups]");
    k = v.size(1) * 8 / bits;
    groups = s.size(1);
    TORCH_CHECK(k % kChunk == 0 && groups * group == k, "the input width ", k, " must be whole chunks of 32 and ",
                "match the scales' ", groups, " groups of ", group);
    values = v.data_ptr<uint8_t>();
    scales = s.data_ptr<float>();
    offsets = o.data_ptr<float>();
  }
  int64_t row_bytes() const { return k * bits / 8; }
};

}  // namespace pagedllm
