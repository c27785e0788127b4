// Prompt chunks' attention straight from the paged KV cache (their keys and values already stored), and the store
// of those keys and values: no gather of the cached prefix, no padding of short chunks to long ones.
#include "attention_common.h"

namespace {

using namespace pagedllm;

// Prompt chunks attended straight from the paged cache (their keys and values are already stored): one work item
// per (chunk, KV head, tile of kTile query tokens). The tile's query heads of the group become rows of one
// score matrix [rows, span] over the blocks the tile can see, each row softmaxed up to its own position (causal,
// and the window when there is one). No gather of the cached prefix, no padding of short chunks to long ones.
constexpr int64_t kTile = 16;

template <typename scalar_t, typename cache_t>
void prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const c10::optional<at::Tensor>& key_scale, const c10::optional<at::Tensor>& key_min,
             const c10::optional<at::Tensor>& value_scale, const c10::optional<at::Tensor>& value_min,
             const at::Tensor& block_table, const at::Tensor& past_lens, const at::Tensor& q_starts,
             const at::Tensor& q_lens, double scale, int64_t window) {
  const int64_t num_chunks = q_starts.size(0);
  const PagedCache<cache_t> cache(key_cache, value_cache, key_scale, key_min, value_scale, value_min, block_table);
  const int64_t num_heads = query.size(1), dim = cache.dim, kv_heads = cache.kv_heads, block_size = cache.block_size;
  const int64_t groups = num_heads / kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* past = past_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);

  // (chunk, first token of the tile) for every tile, times the KV heads below.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t = 0; t < lens[c]; t += kTile) tiles.emplace_back(c, t);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * kv_heads;
  // Later tiles of a long chunk see more keys: threads take every n-th item rather than a contiguous run of them,
  // so each gets a share of the costly ones.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const int64_t per_thread = cdiv(num_items, threads);

  at::parallel_for(0, threads * per_thread, per_thread, [&](int64_t begin, int64_t end) {
    QueryRows<scalar_t, cache_t> q(kTile * groups, dim, scale);
    std::vector<float> acc(kTile * groups * dim), scores;
    std::vector<float> inv_sum(kTile * groups);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = (k % per_thread) * threads + k / per_thread;
      if (item >= num_items) continue;
      const auto [chunk, tile_start] = tiles[item / kv_heads];
      const int64_t head = item % kv_heads;
      const int64_t tokens = std::min(kTile, lens[chunk] - tile_start);
      const int64_t rows = tokens * groups;  // row j * groups + g: query token j of the tile, head g of the group
      const int64_t first_pos = past[chunk] + tile_start;  // position of the tile's first query token
      const int64_t end_len = first_pos + tokens;           // keys [0, end_len) may be seen by some row
      const int64_t first = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g)
          q.set(j * groups + g,
                q_ptr + (starts[chunk] + tile_start + j) * q_tok_stride + (head * groups + g) * q_head_stride);
      const int64_t first_block = first / block_size, end_block = cdiv(end_len, block_size);
      const int64_t origin = first_block * block_size, span = end_block * block_size - origin;
      scores.resize(rows * span);
      cache.score(chunk, head, q, rows, first_block, end_len, scores.data(), span);
      for (int64_t j = 0; j < tokens; ++j) {
        const int64_t pos = first_pos + j;
        const int64_t lo = (window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) - origin, hi = pos + 1 - origin;
        for (int64_t g = 0; g < groups; ++g) {
          float* s = scores.data() + (j * groups + g) * span;
          inv_sum[j * groups + g] = softmax_numerators(s + lo, hi - lo);
          std::fill(s, s + lo, 0.f);
          std::fill(s + hi, s + span, 0.f);
        }
      }
      std::fill(acc.begin(), acc.begin() + rows * dim, 0.f);
      cache.accumulate(chunk, head, scores.data(), rows, first_block, end_len, span, acc.data());
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          scalar_t* dst = out_ptr + ((starts[chunk] + tile_start + j) * num_heads + head * groups + g) * dim;
          const float* a = acc.data() + (j * groups + g) * dim;
          const float inv = inv_sum[j * groups + g];
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
    }
  });
}

#if PAGEDLLM_DPBF16
// bf16 prompt chunks over a bf16 cache as tile GEMMs through torch's brgemm (oneDNN micro-kernels: AMX tiles where
// the CPU has them, AVX512_BF16 dot products otherwise). Each (chunk, KV head) gets its keys and values packed once
// into brgemm's pair-interleaved layout; each tile of kTile query tokens times the group's heads is then two GEMM
// passes over kKeyTile-key slices: scores = Q K^T in float32, softmax in float32, probabilities rounded to bf16,
// out = P V accumulated in float32. No sliding window (the per-row path takes those).
void prefill_bf16_brgemm(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& past_lens,
                         const at::Tensor& q_starts, const at::Tensor& q_lens, double scale) {
  using bf16 = at::BFloat16;
  const int64_t num_chunks = q_starts.size(0), num_heads = query.size(1), kv_heads = key_cache.size(1);
  const int64_t block_size = value_cache.size(2), dim = value_cache.size(3), groups = num_heads / kv_heads;
  const int64_t width = block_table.size(1);
  const bf16* keys = key_cache.data_ptr<bf16>();
  const bf16* values = value_cache.data_ptr<bf16>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* past = past_lens.data_ptr<int64_t>();
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* lens = q_lens.data_ptr<int64_t>();
  const bf16* q_ptr = query.data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  const int64_t q_tok_stride = query.stride(0), q_head_stride = query.stride(1);

  // Keys and values are packed per key tile of kKeyTile positions: keys [dim / 2][kKeyTile][2] (B of Q K^T), values
  // [kKeyTile / 2][dim][2] (B of P V), per KV head. A full tile holds whatever its cache rows hold, so chunks that
  // share cached prefix blocks share its packing: a system prompt is packed once per step, not once per request.
  std::vector<int64_t> padded(num_chunks), first_tile(num_chunks + 1, 0);
  for (int64_t c = 0; c < num_chunks; ++c) {
    padded[c] = round_up(past[c] + lens[c], kKeyTile);
    first_tile[c + 1] = first_tile[c] + padded[c] / kKeyTile;
  }
  std::vector<int64_t> packed_index(first_tile.back());  // (chunk's tile) -> its packed tile
  std::vector<std::pair<int64_t, int64_t>> sources;  // packed tile -> (chunk, first position) to read it from
  std::map<std::vector<int64_t>, int64_t> full_tiles;  // (offset in its first block, block ids) -> packed tile
  std::vector<int64_t> rows_of;
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t0 = 0; t0 < padded[c]; t0 += kKeyTile) {
      int64_t& index = packed_index[first_tile[c] + t0 / kKeyTile];
      if (t0 + kKeyTile <= past[c] + lens[c]) {
        rows_of.assign(1, t0 % block_size);
        for (int64_t b = t0 / block_size; b <= (t0 + kKeyTile - 1) / block_size; ++b)
          rows_of.push_back(table[c * width + b]);
        const auto [it, added] = full_tiles.emplace(rows_of, static_cast<int64_t>(sources.size()));
        index = it->second;
        if (!added) continue;
      } else {
        index = static_cast<int64_t>(sources.size());
      }
      sources.emplace_back(c, t0);
    }
  const int64_t tile_elems = kKeyTile * dim;
  const int64_t packed_elems = static_cast<int64_t>(sources.size()) * kv_heads * tile_elems;
  const auto packed_k = uninitialized<bf16>(packed_elems), packed_v = uninitialized<bf16>(packed_elems);
  const std::vector<uint16_t> zeros(dim, 0);
  at::parallel_for(0, static_cast<int64_t>(sources.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const auto [c, t0] = sources[item / kv_heads];
      pack_tile(keys, values, table + c * width, kv_heads, block_size, item % kv_heads, t0, past[c] + lens[c], dim,
                zeros.data(), kKeyTile, packed_k.get() + item * tile_elems, packed_v.get() + item * tile_elems);
    }
  });

  std::vector<std::pair<int64_t, int64_t>> tiles;  // (chunk, first token of the tile)
  for (int64_t c = 0; c < num_chunks; ++c)
    for (int64_t t = 0; t < lens[c]; t += kTile) tiles.emplace_back(c, t);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * kv_heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const int64_t per_thread = cdiv(num_items, threads);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, threads * per_thread, per_thread, [&](int64_t begin, int64_t end) {
    std::vector<bf16> q(kTile * groups * dim), probs;
    std::vector<float> scores, acc(kTile * groups * dim), inv_sum(kTile * groups);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t item = (k % per_thread) * threads + k / per_thread;  // every n-th: later tiles cost more
      if (item >= num_items) continue;
      const auto [chunk, tile_start] = tiles[item / kv_heads];
      const int64_t head = item % kv_heads, tokens = std::min(kTile, lens[chunk] - tile_start);
      const int64_t rows = tokens * groups;  // row j * groups + g
      const int64_t first_pos = past[chunk] + tile_start, span = round_up(first_pos + tokens, kKeyTile);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const bf16* src =
              q_ptr + (starts[chunk] + tile_start + j) * q_tok_stride + (head * groups + g) * q_head_stride;
          std::copy(src, src + dim, q.data() + (j * groups + g) * dim);
        }
      const auto packed = [&](const std::unique_ptr<bf16[]>& all, int64_t pos) {
        return all.get() + (packed_index[first_tile[chunk] + pos / kKeyTile] * kv_heads + head) * tile_elems;
      };
      // Keys past the tile's last token are masked for every row: the last key tile is cut at a multiple of
      // kKeyStep past it, which saves the masked corner of a causal prompt's work.
      const int64_t seen = round_up(first_pos + tokens, kKeyStep);
      const auto width = [&](int64_t k0) { return std::min(kKeyTile, seen - k0); };
      scores.resize(rows * span);
      for (int64_t n0 = 0; n0 < seen; n0 += kKeyTile)
        at::native::cpublas::brgemm(rows, width(n0), dim, dim, kKeyTile, span, false, q.data(),
                                    packed(packed_k, n0), scores.data() + n0, true);
      probs.resize(rows * span);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = j * groups + g;
          inv_sum[r] = scaled_softmax_bf16(scores.data() + r * span, first_pos + j + 1, seen, fscale,
                                           probs.data() + r * span);
        }
      for (int64_t k0 = 0; k0 < seen; k0 += kKeyTile)
        at::native::cpublas::brgemm(rows, dim, width(k0), span, dim, dim, k0 > 0, probs.data() + k0,
                                    packed(packed_v, k0), acc.data(), true);
      for (int64_t j = 0; j < tokens; ++j)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = j * groups + g;
          bf16* dst = out_ptr + ((starts[chunk] + tile_start + j) * num_heads + head * groups + g) * dim;
          const Vec inv = Vec::broadcast(inv_sum[r]);
          for (int64_t d = 0; d < dim; d += Vec::size) (Vec::load(acc.data() + r * dim + d) * inv).store(dst + d);
        }
    }
    at::native::cpublas::brgemm_release(true);
  });
}
#endif

}  // namespace

// Prompt chunks over the paged cache, their keys and values already stored. out, query: [num_tokens, num_heads,
// head_size] (the step's tokens; only the chunks' rows of out are written); block_table int64 [num_chunks, width];
// past_lens (tokens cached before the chunk), q_starts (first row of the chunk in query), q_lens: int64 [num_chunks].
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                             c10::optional<at::Tensor> key_scale, c10::optional<at::Tensor> key_min,
                             c10::optional<at::Tensor> value_scale, c10::optional<at::Tensor> value_min,
                             at::Tensor block_table, at::Tensor past_lens, at::Tensor q_starts, at::Tensor q_lens,
                             double scale, int64_t window) {
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous(), "query rows and out must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.sizes() == query.sizes(), "out must match query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  for (const at::Tensor* t : {&block_table, &past_lens, &q_starts, &q_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "block_table and lengths must be contiguous int64");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  const bool is_float = query.scalar_type() == at::kFloat;
  TORCH_CHECK(is_float || query.scalar_type() == at::kBFloat16, "paged prefill attention: unsupported query dtype ",
              query.scalar_type());
#if PAGEDLLM_DPBF16
  if (!is_float && key_cache.scalar_type() == at::kBFloat16 && window <= 0 && key_cache.size(3) % 2 == 0) {
    prefill_bf16_brgemm(out, query, key_cache, value_cache, block_table, past_lens, q_starts, q_lens, scale);
    return;
  }
#endif
  switch (key_cache.scalar_type()) {
#define PAGEDLLM_PREFILL(cache_t)                                                                                  \
  if (is_float)                                                                                                    \
    prefill<float, cache_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min,        \
                            block_table, past_lens, q_starts, q_lens, scale, window);                              \
  else                                                                                                             \
    prefill<at::BFloat16, cache_t>(out, query, key_cache, value_cache, key_scale, key_min, value_scale, value_min, \
                                   block_table, past_lens, q_starts, q_lens, scale, window);                       \
  break;
    case at::kFloat: PAGEDLLM_PREFILL(float)
    case at::kBFloat16: PAGEDLLM_PREFILL(at::BFloat16)
    case at::kByte: PAGEDLLM_PREFILL(uint8_t)
#undef PAGEDLLM_PREFILL
    default:
      TORCH_CHECK(false, "paged prefill attention: unsupported cache dtype ", key_cache.scalar_type());
  }
}

// Stores tokens' keys and values [T, kv_heads, head_size] (rows contiguous, any strides above) into float or bfloat16
// caches at their slots int64 [T]: one pass, where a torch row copy first makes the strided rows contiguous.
void store_kv_rows(at::Tensor key_cache, at::Tensor value_cache, at::Tensor keys, at::Tensor values, at::Tensor slots) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "store_kv_rows: contiguous caches");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() && key_cache.scalar_type() != at::kByte,
              "store_kv_rows: float or bfloat16 caches");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && keys.stride(2) == 1 && values.stride(2) == 1 &&
                  keys.scalar_type() == values.scalar_type(),
              "store_kv_rows: keys and values [T, kv_heads, head_size] with contiguous rows, of one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == keys.size(0),
              "store_kv_rows: one int64 slot per token");
  const int64_t tokens = keys.size(0), heads = key_cache.size(1), block_size = key_cache.size(2),
                dim = key_cache.size(3);
  TORCH_CHECK(keys.size(1) == heads && keys.size(2) == dim, "store_kv_rows: rows do not match the cache");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto run = [&](auto cache_tag, auto src_tag) {
    using cache_t = decltype(cache_tag);
    using src_t = decltype(src_tag);
    cache_t* kc = key_cache.data_ptr<cache_t>();
    cache_t* vc = value_cache.data_ptr<cache_t>();
    const src_t* k = keys.data_ptr<src_t>();
    const src_t* v = values.data_ptr<src_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = ((slot[t] / block_size) * heads + h) * block_size + slot[t] % block_size;
          store_row(kc + row * dim, k + t * keys.stride(0) + h * keys.stride(1), dim);
          store_row(vc + row * dim, v + t * values.stride(0) + h * values.stride(1), dim);
        }
    });
  };
  const bool float_cache = key_cache.scalar_type() == at::kFloat, float_src = keys.scalar_type() == at::kFloat;
  TORCH_CHECK(float_src || keys.scalar_type() == at::kBFloat16, "store_kv_rows: float or bfloat16 rows");
  if (float_cache)
    float_src ? run(float{}, float{}) : run(float{}, at::BFloat16{});
  else
    float_src ? run(at::BFloat16{}, float{}) : run(at::BFloat16{}, at::BFloat16{});
}
