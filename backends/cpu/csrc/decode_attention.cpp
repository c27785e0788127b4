// Decode attention straight from the paged KV cache: no gather copy of the cached keys and values.
//
// One work item per (sequence, KV head): the query heads sharing that KV head (GQA group) are scored against every
// cached token in place, softmaxed, and used to sum the values. Blocks that all the decodes' tables begin with (a
// prompt prefix shared through the prefix cache) are attended first, once per tile of sequences (bf16: as tile GEMMs
// through brgemm). Each pass over a sequence's blocks asks for the blocks of the pass after it (its values, then the
// next item's keys) into L2, so memory reads overlap with arithmetic.
#include "attention_common.h"

namespace {

using namespace pagedllm;

#if PAGEDLLM_DPBF16
// The shared prefix of bf16 decodes over a bf16 cache as tile GEMMs (see prefill_bf16_brgemm below): its keys and
// values are packed once per KV head, then each tile of kSeqTile sequences times the group's heads is two GEMM
// passes, scores in float32 and probabilities rounded to bf16. Writes what the per-row path writes: the
// unnormalized sums, the largest scaled score and the sum of numerators of each (sequence, query head).
void shared_prefix_bf16_brgemm(const at::BFloat16* q_ptr, int64_t q_seq_stride, int64_t q_head_stride,
                               const at::BFloat16* keys, const at::BFloat16* values, const int64_t* blocks,
                               int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t block_size,
                               int64_t dim, int64_t shared_len, double scale, float* shared_acc, float* shared_max,
                               float* shared_sum) {
  using bf16 = at::BFloat16;
  const int64_t groups = num_heads / kv_heads, span = round_up(shared_len, kKeyTile), key_tiles = span / kKeyTile;
  // Per KV head, the whole prefix as one GEMM operand each: keys [dim / 2][span][2], values [span / 2][dim][2].
  const auto packed_k = uninitialized<bf16>(kv_heads * span * dim);
  const auto packed_v = uninitialized<bf16>(kv_heads * span * dim);
  const std::vector<uint16_t> zeros(dim, 0);
  at::parallel_for(0, kv_heads * key_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / key_tiles, t0 = (item % key_tiles) * kKeyTile;
      pack_tile(keys, values, blocks, kv_heads, block_size, h, t0, shared_len, dim, zeros.data(), span,
                packed_k.get() + h * span * dim + t0 * 2, packed_v.get() + h * span * dim + t0 * dim);
    }
  });
  const int64_t seq_tiles = cdiv(num_seqs, kSeqTile);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, seq_tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    const auto q = uninitialized<bf16>(kSeqTile * groups * dim);
    const auto probs = uninitialized<bf16>(kSeqTile * groups * span);
    std::vector<float> scores(kSeqTile * groups * span), acc(kSeqTile * groups * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_seq = (item / kv_heads) * kSeqTile, head = item % kv_heads;
      const int64_t rows = std::min(kSeqTile, num_seqs - first_seq) * groups;  // row j * groups + g
      for (int64_t r = 0; r < rows; ++r) {
        const bf16* src =
            q_ptr + (first_seq + r / groups) * q_seq_stride + (head * groups + r % groups) * q_head_stride;
        std::copy(src, src + dim, q.get() + r * dim);
      }
      at::native::cpublas::brgemm(rows, span, dim, dim, span, span, false, q.get(),
                                  packed_k.get() + head * span * dim, scores.data(), true);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
        shared_sum[at] = 1.f / scaled_softmax_bf16(scores.data() + r * span, shared_len, span, fscale,
                                                   probs.get() + r * span, &shared_max[at]);
      }
      at::native::cpublas::brgemm(rows, dim, span, span, dim, dim, false, probs.get(),
                                  packed_v.get() + head * span * dim, acc.data(), true);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
        std::copy(acc.begin() + r * dim, acc.begin() + (r + 1) * dim, shared_acc + at * dim);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#endif

template <typename scalar_t, typename cache_t>
void decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
            const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
            const c10::optional<at::Tensor>& key_min, const c10::optional<at::Tensor>& value_scale,
            const c10::optional<at::Tensor>& value_min, const at::Tensor& block_table,
            const at::Tensor& seq_lens, double scale, int64_t window, const c10::optional<at::Tensor>& new_keys,
            const c10::optional<at::Tensor>& new_values, const c10::optional<at::Tensor>& slots,
            int64_t shared_blocks) {
  const int64_t num_seqs = query.size(0);
  const PagedCache<cache_t> cache(key_cache, value_cache, key_scale, key_min, value_scale, value_min, block_table);
  const int64_t num_heads = query.size(1), dim = cache.dim, kv_heads = cache.kv_heads, block_size = cache.block_size;
  const int64_t groups = num_heads / kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);
  // This step's key and value of each sequence, stored into its slot by the thread that reads the block next: the
  // block read that follows pays for those cache lines once, where a separate row copy would fetch them twice.
  const bool write_new = new_keys.has_value();
  const scalar_t* nk_ptr = write_new ? new_keys->data_ptr<scalar_t>() : nullptr;
  const scalar_t* nv_ptr = write_new ? new_values->data_ptr<scalar_t>() : nullptr;
  const int64_t nk_seq_stride = write_new ? new_keys->stride(0) : 0;
  const int64_t nk_head_stride = write_new ? new_keys->stride(1) : 0;
  const int64_t nv_seq_stride = write_new ? new_values->stride(0) : 0;
  const int64_t nv_head_stride = write_new ? new_values->stride(1) : 0;
  const int64_t* slot_ptr = write_new ? slots->data_ptr<int64_t>() : nullptr;
  cache_t* k_out = const_cast<cache_t*>(cache.keys);
  cache_t* v_out = const_cast<cache_t*>(cache.values);

  // Blocks that every sequence's table starts with (a shared prompt prefix) are attended once per tile of
  // sequences: each block is read once for the tile's query rows instead of once per sequence. Their unnormalized
  // sums, maxima and softmax denominators are merged with each sequence's own blocks below.
  const int64_t shared_len = shared_blocks * block_size;
  std::vector<float> shared_acc, shared_max, shared_sum;
  if (shared_blocks > 0) {
    shared_acc.resize(num_seqs * num_heads * dim);
    shared_max.resize(num_seqs * num_heads);
    shared_sum.resize(num_seqs * num_heads);
    bool done = false;
#if PAGEDLLM_DPBF16
    if constexpr (QueryRows<scalar_t, cache_t>::kBf16)
      if (dim % 32 == 0) {
        shared_prefix_bf16_brgemm(q_ptr, q_seq_stride, q_head_stride, cache.keys, cache.values, cache.table, num_seqs,
                                  num_heads, kv_heads, block_size, dim, shared_len, scale, shared_acc.data(),
                                  shared_max.data(), shared_sum.data());
        done = true;
      }
#endif
    if (!done) {
      const int64_t tiles = cdiv(num_seqs, kSeqTile);
      at::parallel_for(0, tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
        QueryRows<scalar_t, cache_t> q(kSeqTile * groups, dim, scale);
        std::vector<float> acc(kSeqTile * groups * dim), scores(kSeqTile * groups * shared_len);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t first_seq = (item / kv_heads) * kSeqTile, head = item % kv_heads;
          const int64_t rows = std::min(kSeqTile, num_seqs - first_seq) * groups;  // row j * groups + g
          for (int64_t r = 0; r < rows; ++r)
            q.set(r, q_ptr + (first_seq + r / groups) * q_seq_stride + (head * groups + r % groups) * q_head_stride);
          cache.score(first_seq, head, q, rows, 0, shared_len, scores.data(), shared_len);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
            shared_sum[at] = 1.f / softmax_numerators(scores.data() + r * shared_len, shared_len, &shared_max[at]);
          }
          std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
          cache.accumulate(first_seq, head, scores.data(), rows, 0, shared_len, shared_len, acc.data());
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t at = (first_seq + r / groups) * num_heads + head * groups + r % groups;
            std::copy(acc.begin() + r * dim, acc.begin() + (r + 1) * dim, shared_acc.begin() + at * dim);
          }
        }
      });
    }
  }

  // The first key a sequence of `len` tokens reads here: past the window, or past the shared prefix.
  const auto first_key = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : shared_len; };
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    QueryRows<scalar_t, cache_t> q(groups, dim, scale);
    std::vector<float> acc(groups * dim), scores, inv_sum(groups);
    std::vector<float> peak(groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = first_key(len);
      if (write_new) {
        const int64_t slot = slot_ptr[seq];
        const int64_t row = ((slot / block_size) * kv_heads + head) * block_size + slot % block_size;
        store_row(k_out + row * dim, nk_ptr + seq * nk_seq_stride + head * nk_head_stride, dim);
        store_row(v_out + row * dim, nv_ptr + seq * nv_seq_stride + head * nv_head_stride, dim);
      }
      for (int64_t g = 0; g < groups; ++g) q.set(g, q_ptr + seq * q_seq_stride + (head * groups + g) * q_head_stride);
      // Scores are laid out per block-aligned position from the first block, so blocks never straddle rows.
      const int64_t first_block = first / block_size, end_block = cdiv(len, block_size);
      const int64_t origin = first_block * block_size, span = end_block * block_size - origin;
      scores.resize(groups * span);
      // Pass 1: scores of every query head of the group against every cached key, block by block.
      cache.score(seq, head, q, groups, first_block, len, scores.data(), span);
      for (int64_t g = 0; g < groups; ++g) {
        float* s = scores.data() + g * span;
        const int64_t lo = first - origin, hi = len - origin;  // the keys this query may see
        inv_sum[g] = softmax_numerators(s + lo, hi - lo, &peak[g]);
        std::fill(s, s + lo, 0.f);
        std::fill(s + hi, s + span, 0.f);
      }
      // Pass 2: the probability-weighted sum of the values, while the next item's keys are fetched.
      typename PagedCache<cache_t>::Later next_keys;
      if (item + 1 < end) {
        const int64_t next_seq = (item + 1) / kv_heads, next_len = lens[next_seq];
        next_keys = cache.later(cache.keys, next_seq, (item + 1) % kv_heads, first_key(next_len) / block_size,
                                next_len);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      cache.accumulate(seq, head, scores.data(), groups, first_block, len, span, acc.data(), next_keys);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = seq * num_heads + head * groups + g;
        scalar_t* dst = out_ptr + at * dim;
        if (shared_blocks > 0) {  // merged with the shared prefix's part, both rescaled to the larger maximum
          const float top = std::max(peak[g], shared_max[at]);
          const float own = exp_nonpositive(peak[g] - top), prefix = exp_nonpositive(shared_max[at] - top);
          const float inv = 1.f / (own / inv_sum[g] + prefix * shared_sum[at]);
          const float* part = shared_acc.data() + at * dim;
          for (int64_t d = 0; d < dim; ++d)
            dst[d] = static_cast<scalar_t>((acc[g * dim + d] * own + part[d] * prefix) * inv);
        } else {
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * dim + d] * inv_sum[g]);
        }
      }
    }
  });
}

template <typename scalar_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& key_min, const c10::optional<at::Tensor>& value_scale,
                    const c10::optional<at::Tensor>& value_min, const at::Tensor& block_table,
                    const at::Tensor& seq_lens, double scale, int64_t window,
                    const c10::optional<at::Tensor>& new_keys, const c10::optional<at::Tensor>& new_values,
                    const c10::optional<at::Tensor>& slots, int64_t shared_blocks) {
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode<scalar_t, float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                              block_table, seq_lens, scale, window, new_keys, new_values, slots,
                              shared_blocks);
      break;
    case at::kBFloat16:
      decode<scalar_t, at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale,
                                     value_min, block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                     shared_blocks);
      break;
    case at::kByte:
      decode<scalar_t, uint8_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                shared_blocks);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported cache dtype ", key_cache.scalar_type());
  }
}

}  // namespace

// out, query: [num_seqs, num_heads, head_size]; block_table: int64 [num_seqs, width]; seq_lens: int64 [num_seqs]
// (counting this step's token). new_keys/new_values [num_seqs, kv_heads, head_size] and slots int64 [num_seqs], when
// given, are written into the caches first (float and bfloat16 caches). The first shared_blocks columns of
// block_table must be the same blocks for every sequence (a shared prefix, full blocks, each sequence longer).
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scale,
                            c10::optional<at::Tensor> key_min, c10::optional<at::Tensor> value_scale,
                            c10::optional<at::Tensor> value_min, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<at::Tensor> new_keys, c10::optional<at::Tensor> new_values,
                            c10::optional<at::Tensor> slots, int64_t shared_blocks) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous(), "query rows and out must be contiguous");
  if (new_keys.has_value()) {
    TORCH_CHECK(new_values.has_value() && slots.has_value(), "new_keys needs new_values and slots");
    TORCH_CHECK(new_keys->scalar_type() == query.scalar_type() && new_values->scalar_type() == query.scalar_type(),
                "new keys and values must have the query's dtype");
    TORCH_CHECK(new_keys->stride(2) == 1 && new_values->stride(2) == 1, "new key and value rows must be contiguous");
    TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous(), "slots must be contiguous int64");
    TORCH_CHECK(key_cache.scalar_type() != at::kByte, "u8 caches are written before the call");
  }
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table and seq_lens must be contiguous");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(shared_blocks >= 0 && shared_blocks <= block_table.size(1), "shared_blocks out of range");
  if (shared_blocks > 0) {
    TORCH_CHECK(window <= 0, "shared_blocks cannot be used with a sliding window");
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    for (int64_t i = 0; i < seq_lens.size(0); ++i)
      TORCH_CHECK(lens[i] > shared_blocks * value_cache.size(2),
                  "every sequence must extend past its shared blocks");
  }
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_cache<float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                            block_table, seq_lens, scale, window, new_keys, new_values, slots,
                            shared_blocks);
      break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                   block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                   shared_blocks);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported query dtype ", query.scalar_type());
  }
}
