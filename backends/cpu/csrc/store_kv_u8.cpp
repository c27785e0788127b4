// Writes of a u8 KV cache. Values are quantized per token and head (a scale and minimum over the head's
// channels); keys per channel of each block (a scale and minimum over the block's tokens, per head and channel),
// as OpenVINO's CPU plugin keeps them: a few key channels carry most of the magnitude, and a scale per token would
// spend its 256 levels on them. A block's key range can only grow as its tokens arrive; when a new token falls
// outside it, the block's earlier keys in that channel are quantized again to the wider range.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float kLevels = 255.f;
constexpr float kTinyRange = 1e-8f;  // a constant channel or token still gets a positive scale

inline uint8_t level(float x, float minimum, float inverse_scale) {
  return static_cast<uint8_t>(std::clamp(std::nearbyint((x - minimum) * inverse_scale), 0.f, kLevels));
}

// A run of consecutive tokens written into one block (a sequence's tokens in a step, in position order).
struct Run {
  int64_t first_token, count, block, first_offset;
};

std::vector<Run> runs_of(const int64_t* slots, int64_t tokens, int64_t block_size) {
  std::vector<Run> runs;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    if (!runs.empty() && runs.back().block == block && runs.back().first_offset + runs.back().count == offset)
      ++runs.back().count;
    else
      runs.push_back({t, 1, block, offset});
  }
  return runs;
}

template <typename scalar_t>
void store(at::Tensor& key_cache, at::Tensor& key_scale, at::Tensor& key_min, at::Tensor& value_cache,
           at::Tensor& value_scale, at::Tensor& value_min, const at::Tensor& keys, const at::Tensor& values,
           const at::Tensor& slots) {
  const int64_t heads = value_cache.size(1), block_size = value_cache.size(2), dim = value_cache.size(3);
  const int64_t tokens = keys.size(0);
  const std::vector<Run> runs = runs_of(slots.data_ptr<int64_t>(), tokens, block_size);
  const scalar_t* k = keys.data_ptr<scalar_t>();
  const scalar_t* v = values.data_ptr<scalar_t>();
  const int64_t k_token = keys.stride(0), k_head = keys.stride(1), v_token = values.stride(0),
                v_head = values.stride(1);
  uint8_t* kc = key_cache.data_ptr<uint8_t>();
  uint8_t* vc = value_cache.data_ptr<uint8_t>();
  float* ks = key_scale.data_ptr<float>();
  float* km = key_min.data_ptr<float>();
  float* vs = value_scale.data_ptr<float>();
  float* vm = value_min.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(runs.size()) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const Run& run = runs[unit / heads];
      const int64_t h = unit % heads, bh = run.block * heads + h;
      uint8_t* kblock = kc + bh * block_size * dim;
      float* scale = ks + bh * dim;
      float* minimum = km + bh * dim;
      for (int64_t d = 0; d < dim; ++d) {  // keys: channel d of the block
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int64_t i = 0; i < run.count; ++i) {
          const float x = static_cast<float>(k[(run.first_token + i) * k_token + h * k_head + d]);
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        if (run.first_offset > 0) {  // the block holds earlier keys: keep their range unless this one leaves it
          const float old_lo = minimum[d], old_scale = scale[d], old_hi = old_lo + old_scale * kLevels;
          if (lo >= old_lo && hi <= old_hi) {
            lo = old_lo;
            hi = old_hi;
          } else {
            lo = std::min(lo, old_lo);
            hi = std::max(hi, old_hi);
            const float inverse = kLevels / std::max(hi - lo, kTinyRange);
            for (int64_t o = 0; o < run.first_offset; ++o) {
              uint8_t& q = kblock[d * block_size + o];
              q = level(q * old_scale + old_lo, lo, inverse);
            }
          }
        }
        const float range = std::max(hi - lo, kTinyRange), inverse = kLevels / range;
        for (int64_t i = 0; i < run.count; ++i)
          kblock[d * block_size + run.first_offset + i] =
              level(static_cast<float>(k[(run.first_token + i) * k_token + h * k_head + d]), lo, inverse);
        scale[d] = range / kLevels;
        minimum[d] = lo;
      }
      for (int64_t i = 0; i < run.count; ++i) {  // values: each token of the run
        const scalar_t* x = v + (run.first_token + i) * v_token + h * v_head;
        const int64_t row = bh * block_size + run.first_offset + i;
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int64_t d = 0; d < dim; ++d) {
          lo = std::min(lo, static_cast<float>(x[d]));
          hi = std::max(hi, static_cast<float>(x[d]));
        }
        const float range = std::max(hi - lo, kTinyRange), s = range / kLevels, inverse = kLevels / range;
        for (int64_t d = 0; d < dim; ++d) vc[row * dim + d] = level(static_cast<float>(x[d]), lo, inverse);
        vs[row] = s;
        vm[row] = lo;
      }
    }
  });
}

}  // namespace

// keys/values [T, heads, head_size] (float32 or bf16, rows of contiguous elements) into a u8 cache: key_cache
// [blocks, heads, head_size, block_size] u8 (channel-major in a block: see attention_common.h), value_cache
// [blocks, heads, block_size, head_size] u8; key_scale/key_min [blocks, heads, head_size] float32 (per
// block and channel); value_scale/value_min [blocks, heads, block_size, 1] float32 (per token). slots [T] int64:
// block * block_size + offset, a sequence's tokens in position order.
void store_kv_u8(at::Tensor key_cache, at::Tensor key_scale, at::Tensor key_min, at::Tensor value_cache,
                 at::Tensor value_scale, at::Tensor value_min, at::Tensor keys, at::Tensor values, at::Tensor slots) {
  TORCH_CHECK(key_cache.scalar_type() == at::kByte && value_cache.scalar_type() == at::kByte, "u8 caches");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_scale.is_contiguous() &&
                  key_min.is_contiguous() && value_scale.is_contiguous() && value_min.is_contiguous(),
              "contiguous caches");
  TORCH_CHECK(key_cache.size(2) == value_cache.size(3) && key_cache.size(3) == value_cache.size(2),
              "u8 keys are [blocks, heads, head_size, block_size]");
  TORCH_CHECK(key_scale.numel() == key_cache.size(0) * key_cache.size(1) * key_cache.size(2),
              "key scales: one per block, head and channel");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type() && keys.stride(2) == 1 && values.stride(2) == 1,
              "keys and values of one dtype, rows contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == keys.size(0),
              "slots: contiguous int64, one per token");
  if (keys.size(0) == 0) return;
  if (keys.scalar_type() == at::kFloat)
    store<float>(key_cache, key_scale, key_min, value_cache, value_scale, value_min, keys, values, slots);
  else if (keys.scalar_type() == at::kBFloat16)
    store<at::BFloat16>(key_cache, key_scale, key_min, value_cache, value_scale, value_min, keys, values, slots);
  else
    TORCH_CHECK(false, "store_kv_u8: float32 or bf16 keys and values");
}
