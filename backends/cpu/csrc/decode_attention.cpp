// Decode attention straight from the paged KV cache: no gather copy of the cached keys and values.
//
// One work item per (sequence, KV head): the query heads sharing that KV head (GQA group) are scored against the
// cached tokens in place, softmaxed, and used to sum the values, a chunk of blocks at a time with an online softmax.
// While a chunk's keys are scored its values are asked for into L2, and while they are summed, the next chunk's keys.
// With fewer items than threads can share (batch-1 decode has as many as KV heads), a long sequence is cut into runs of
// chunks whose partial sums are merged after (split-K, as flash-decoding). Blocks that all the decodes' tables begin
// with (a prompt prefix shared through the prefix cache) are attended first, once per tile of sequences (bf16: as tile
// GEMMs through brgemm), and merged the same way.
#include "attention_common.h"

namespace {

using namespace pagedllm;

// Bytes of one cache per chunk of a sequence's keys: a chunk's values are fetched into L2 while its keys are scored and
// summed right after, so long contexts do not evict them first (as whole-sequence passes did).
constexpr int64_t kChunkBytes = 128 << 10;
// Runs one (sequence, KV head) may be cut into, to give every thread work when there are few sequences.
constexpr int64_t kMaxRuns = 64;

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
            int64_t shared_blocks, bool split_runs) {
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
  // A work item is one (sequence, KV head), cut into `parts` runs of whole chunks when there are too few of them to
  // share the threads evenly (one sequence has only as many as KV heads); the runs' partial sums are merged after.
  const int64_t pairs = num_seqs * kv_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk_blocks =
      std::max<int64_t>(1, kChunkBytes / (block_size * dim * static_cast<int64_t>(sizeof(cache_t))));
  int64_t most_chunks = 1;  // a run is whole chunks: no more runs than the longest sequence has chunks
  for (int64_t i = 0; i < num_seqs; ++i)
    most_chunks =
        std::max(most_chunks, cdiv(cdiv(lens[i], block_size) - first_key(lens[i]) / block_size, chunk_blocks));
  const int64_t parts =
      !split_runs || pairs >= 2 * threads ? 1 : std::min({kMaxRuns, most_chunks, cdiv(2 * threads, pairs)});
  struct Run {
    int64_t seq, head, len, first, begin_block, end_block;
    bool last;  // the run holding the sequence's newest token
  };
  const auto run_of = [&](int64_t item, Run& r) {
    const int64_t pair = item / parts, part = item % parts;
    r.seq = pair / kv_heads;
    r.head = pair % kv_heads;
    r.len = lens[r.seq];
    r.first = first_key(r.len);
    const int64_t first_block = r.first / block_size, end_block = cdiv(r.len, block_size);
    const int64_t chunks = cdiv(end_block - first_block, chunk_blocks), used = std::min(parts, chunks);
    if (part >= used) return false;
    r.begin_block = first_block + part * chunks / used * chunk_blocks;
    r.end_block = std::min(end_block, first_block + (part + 1) * chunks / used * chunk_blocks);
    r.last = part == used - 1;
    return true;
  };
  // Each run's unnormalized sums, largest scores and sums of numerators, when there are several per item.
  std::vector<float> run_acc(parts > 1 ? pairs * parts * groups * dim : 0);
  std::vector<float> run_peak(parts > 1 ? pairs * parts * groups : 0), run_sum(run_peak.size());
  // dst = the softmax-weighted sum of the values from `n` runs' partial sums over disjoint keys (a run whose sum is
  // 0 saw no keys), and the shared prefix's when there is one: each rescaled to the largest score of all.
  const auto merge = [&](int64_t at, int64_t n, const float* const* acc, const float* peak, const float* sum) {
    scalar_t* dst = out_ptr + at * dim;
    if (n == 1 && shared_blocks == 0) {  // nothing to merge: a loop the compiler vectorizes
      const float inv = 1.f / sum[0];
      for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(acc[0][d] * inv);
      return;
    }
    float top = shared_blocks > 0 ? shared_max[at] : -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i)
      if (sum[i] > 0.f) top = std::max(top, peak[i]);
    float weights[kMaxRuns + 1], denominator = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      weights[i] = sum[i] > 0.f ? exp_nonpositive(peak[i] - top) : 0.f;
      denominator += weights[i] * sum[i];
    }
    const float prefix = shared_blocks > 0 ? exp_nonpositive(shared_max[at] - top) : 0.f;
    if (shared_blocks > 0) denominator += prefix * shared_sum[at];
    const float inv = 1.f / denominator;
    for (int64_t d = 0; d < dim; ++d) {
      float value = shared_blocks > 0 ? shared_acc[at * dim + d] * prefix : 0.f;
      for (int64_t i = 0; i < n; ++i) value += weights[i] == 0.f ? 0.f : acc[i][d] * weights[i];
      dst[d] = static_cast<scalar_t>(value * inv);
    }
  };
  at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
    QueryRows<scalar_t, cache_t> q(groups, dim, scale);
    std::vector<float> acc(groups * dim), scores(groups * chunk_blocks * block_size), peak(groups), sum(groups);
    Run r, next;
    int64_t next_item = begin;
    const auto find_next = [&](int64_t from) {
      for (next_item = from; next_item < end; ++next_item)
        if (run_of(next_item, next)) return true;
      return false;
    };
    bool have = find_next(begin);
    while (have) {
      r = next;
      const int64_t item = next_item;
      have = find_next(item + 1);
      if (write_new && r.last) {
        const int64_t slot = slot_ptr[r.seq];
        const int64_t row = ((slot / block_size) * kv_heads + r.head) * block_size + slot % block_size;
        store_row(k_out + row * dim, nk_ptr + r.seq * nk_seq_stride + r.head * nk_head_stride, dim);
        store_row(v_out + row * dim, nv_ptr + r.seq * nv_seq_stride + r.head * nv_head_stride, dim);
      }
      for (int64_t g = 0; g < groups; ++g)
        q.set(g, q_ptr + r.seq * q_seq_stride + (r.head * groups + g) * q_head_stride);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      // Chunk by chunk: its keys scored while its values are fetched, the scores' numerators rescaled to the
      // largest score so far (online softmax), then its values summed while the next chunk's keys are fetched.
      for (int64_t b0 = r.begin_block; b0 < r.end_block; b0 += chunk_blocks) {
        const int64_t b1 = std::min(r.end_block, b0 + chunk_blocks);
        const int64_t origin = b0 * block_size, span = (b1 - b0) * block_size;
        const int64_t stop = std::min(r.len, b1 * block_size);  // one past the chunk's last key
        cache.score(r.seq, r.head, q, groups, b0, stop, scores.data(), span);
        for (int64_t g = 0; g < groups; ++g) {
          float* s = scores.data() + g * span;
          const int64_t lo = std::max<int64_t>(0, r.first - origin), hi = stop - origin;  // the keys it may see
          float chunk_peak;
          float chunk_sum = 1.f / softmax_numerators(s + lo, hi - lo, &chunk_peak);
          std::fill(s, s + lo, 0.f);
          std::fill(s + hi, s + span, 0.f);
          if (chunk_peak > peak[g]) {
            if (sum[g] > 0.f) {
              const float shrink = exp_nonpositive(peak[g] - chunk_peak);
              for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= shrink;
              sum[g] *= shrink;
            }
            peak[g] = chunk_peak;
          } else {
            const float shrink = exp_nonpositive(chunk_peak - peak[g]);
            for (int64_t t = lo; t < hi; ++t) s[t] *= shrink;
            chunk_sum *= shrink;
          }
          sum[g] += chunk_sum;
        }
        typename PagedCache<cache_t>::Later next_keys;
        if (b1 < r.end_block)
          next_keys = cache.later(cache.keys, r.seq, r.head, b1, std::min(r.len, r.end_block * block_size));
        else if (have)
          next_keys = cache.later(cache.keys, next.seq, next.head, next.begin_block,
                                  std::min(next.len, next.end_block * block_size));
        cache.accumulate(r.seq, r.head, scores.data(), groups, b0, stop, span, acc.data(), next_keys);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = r.seq * num_heads + r.head * groups + g;
        if (parts == 1) {
          const float* own = acc.data() + g * dim;
          merge(at, 1, &own, &peak[g], &sum[g]);
        } else {
          const int64_t slot = item * groups + g;
          std::copy(acc.begin() + g * dim, acc.begin() + (g + 1) * dim, run_acc.begin() + slot * dim);
          run_peak[slot] = peak[g];
          run_sum[slot] = sum[g];
        }
      }
    }
  });
  if (parts > 1) {
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      const float* accs[kMaxRuns];
      float peaks[kMaxRuns], sums[kMaxRuns];
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t seq = pair / kv_heads, head = pair % kv_heads;
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t p = 0; p < parts; ++p) {
            const int64_t slot = (pair * parts + p) * groups + g;
            accs[p] = run_acc.data() + slot * dim;
            peaks[p] = run_peak[slot];
            sums[p] = run_sum[slot];
          }
          merge(seq * num_heads + head * groups + g, parts, accs, peaks, sums);
        }
      }
    });
  }
}

template <typename scalar_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const c10::optional<at::Tensor>& key_scale,
                    const c10::optional<at::Tensor>& key_min, const c10::optional<at::Tensor>& value_scale,
                    const c10::optional<at::Tensor>& value_min, const at::Tensor& block_table,
                    const at::Tensor& seq_lens, double scale, int64_t window,
                    const c10::optional<at::Tensor>& new_keys, const c10::optional<at::Tensor>& new_values,
                    const c10::optional<at::Tensor>& slots, int64_t shared_blocks, bool split_runs) {
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode<scalar_t, float>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                              block_table, seq_lens, scale, window, new_keys, new_values, slots,
                              shared_blocks, split_runs);
      break;
    case at::kBFloat16:
      decode<scalar_t, at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale,
                                     value_min, block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                     shared_blocks, split_runs);
      break;
    case at::kByte:
      decode<scalar_t, uint8_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                shared_blocks, split_runs);
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
// split_runs lets a long sequence be cut into runs for threads that few sequences would leave idle; false keeps each
// sequence's sums in one order whatever else is in the batch (batch invariance).
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scale,
                            c10::optional<at::Tensor> key_min, c10::optional<at::Tensor> value_scale,
                            c10::optional<at::Tensor> value_min, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<at::Tensor> new_keys, c10::optional<at::Tensor> new_values,
                            c10::optional<at::Tensor> slots, int64_t shared_blocks, bool split_runs) {
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
                            shared_blocks, split_runs);
      break;
    case at::kBFloat16:
      dispatch_cache<at::BFloat16>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,
                                   block_table, seq_lens, scale, window, new_keys, new_values, slots,
                                   shared_blocks, split_runs);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention: unsupported query dtype ", query.scalar_type());
  }
}
