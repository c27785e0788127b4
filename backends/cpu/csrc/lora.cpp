// LoRA adapters' low-rank products added to a projection's output, several adapters in one call (layers/lora.py):
// out[row] += (x[row] @ A[slot]) @ B[slot] for each row that asked for an adapter. The rows come in tiles of up to
// kTileRows rows of one adapter, so each element of A and B read serves a whole tile; the products are summed in
// float32 and added to the output once. In torch the same is about seven ops per projection (gather, two batched
// GEMMs, conversions, a scatter-add), each a pass of its own, which cost more than the products.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

#if defined(PAGEDLLM_VEC)
using pagedllm::Vec;
constexpr int64_t kLanes = Vec::size;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kTileRows = kLanes == 16 ? 8 : 4;  // a tile's accumulators, kTileRows x 2 vectors, in registers

// The tile's rows of x as float32, rows past count zero (every tile is summed as a whole one).
template <typename T>
void load_rows(const T* x, int64_t in, const int64_t* rows, int64_t count, float* xt) {
  std::fill(xt + count * in, xt + kTileRows * in, 0.f);
  for (int64_t r = 0; r < count; ++r) {
    const T* src = x + rows[r] * in;
    for (int64_t k = 0; k < in; ++k) xt[r * in + k] = static_cast<float>(src[k]);
  }
}

#if defined(PAGEDLLM_VEC)
// t[:, c:c + NV * kLanes] = xt @ a[:, c:c + NV * kLanes] (a: [in, rank]; t: [kTileRows, rank]).
template <int NV, typename W>
void shrink_block(const float* xt, int64_t in, const W* a, int64_t rank, int64_t c, float* t) {
  Vec acc[kTileRows][NV];
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  for (int64_t k = 0; k < in; ++k) {
    Vec av[NV];
    for (int v = 0; v < NV; ++v) av[v] = Vec::load(a + k * rank + c + v * kLanes);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const Vec xv = Vec::broadcast(xt[r * in + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(xv, av[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(t + r * rank + c + v * kLanes);
}

// out[rows[r]][c:c + NV * kLanes] += t[r][r0:r1] @ b[r0:r1, c:c + NV * kLanes] (b: [rank, n]).
template <int NV, typename W, typename T>
void expand_block(const float* t, int64_t rank, int64_t count, const W* b, int64_t n, int64_t c, int64_t r0,
                  int64_t r1, T* out, const int64_t* rows) {
  Vec acc[kTileRows][NV];
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  for (int64_t j = r0; j < r1; ++j) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = Vec::load(b + j * n + c + v * kLanes);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const Vec tv = Vec::broadcast(t[r * rank + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(tv, bv[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    T* o = out + rows[r] * n + c;
    for (int v = 0; v < NV; ++v) (Vec::load(o + v * kLanes) + acc[r][v]).store(o + v * kLanes);
  }
}
#endif

// t = xt @ a for the whole tile: two vectors of columns at a time, then one, then the rest one by one.
template <typename W>
void shrink(const float* xt, int64_t in, const W* a, int64_t rank, float* t) {
  int64_t c = 0;
#if defined(PAGEDLLM_VEC)
  for (; c + 2 * kLanes <= rank; c += 2 * kLanes) shrink_block<2>(xt, in, a, rank, c, t);
  for (; c + kLanes <= rank; c += kLanes) shrink_block<1>(xt, in, a, rank, c, t);
#endif
  for (; c < rank; ++c) {
    for (int64_t r = 0; r < kTileRows; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < in; ++k) sum += xt[r * in + k] * static_cast<float>(a[k * rank + c]);
      t[r * rank + c] = sum;
    }
  }
}

// out[rows[r]][c0:c1] += t[r][r0:r1] @ b[r0:r1, c0:c1] for the tile's count rows.
template <typename W, typename T>
void expand(const float* t, int64_t rank, int64_t count, const W* b, int64_t n, int64_t c0, int64_t c1,
            int64_t r0, int64_t r1, T* out, const int64_t* rows) {
  int64_t c = c0;
#if defined(PAGEDLLM_VEC)
  for (; c + 2 * kLanes <= c1; c += 2 * kLanes) expand_block<2>(t, rank, count, b, n, c, r0, r1, out, rows);
  for (; c + kLanes <= c1; c += kLanes) expand_block<1>(t, rank, count, b, n, c, r0, r1, out, rows);
#endif
  for (; c < c1; ++c) {
    for (int64_t r = 0; r < count; ++r) {
      float sum = 0.f;
      for (int64_t j = r0; j < r1; ++j) sum += t[r * rank + j] * static_cast<float>(b[j * n + c]);
      T* o = out + rows[r] * n + c;
      *o = static_cast<T>(static_cast<float>(*o) + sum);
    }
  }
}

}  // namespace

// out [rows, n] += (x[row] @ a[slot]) @ b[slot] for each group's rows, in place.
// x [rows, in] and out: float32 or bf16, the same type; a [slots, in, rank] and b [slots, rank, n]: both float32 or
// both bf16 (a bf16 model's: half the bytes to read, summed in float32 all the same),
// each adapter's scale folded in; parts: int64 [slots, P, 4] = (first column, end column, first rank, end rank) of
// each part of a fused projection (empty ranges for parts an adapter leaves out); row_index: int64 rows grouped by
// adapter; groups: int64 [groups, 3] = (offset in row_index, rows, slot).
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& parts,
              const at::Tensor& row_index, const at::Tensor& groups) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && x.dim() == 2 && x.is_contiguous() && x.size(0) == out.size(0),
              "lora_add: out and x must be contiguous [rows, features] of the same rows");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lora_add: out and x must have one type");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
              a.scalar_type() == b.scalar_type() && a.is_contiguous() && b.is_contiguous(),
              "lora_add: a and b must be contiguous stacks, both float32 or both bf16");
  TORCH_CHECK(parts.scalar_type() == at::kLong && row_index.scalar_type() == at::kLong &&
              groups.scalar_type() == at::kLong && parts.is_contiguous() && groups.is_contiguous() &&
              row_index.is_contiguous(), "lora_add: parts, row_index and groups must be contiguous int64");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && parts.dim() == 3 && groups.dim() == 2 && groups.size(1) == 3,
              "lora_add: a, b, parts [slots, ...] and groups [groups, 3]");
  const int64_t in = x.size(1), n = out.size(1), rank = a.size(2), slots = a.size(0), num_parts = parts.size(1);
  TORCH_CHECK(a.size(1) == in && b.size(0) == slots && b.size(1) == rank && b.size(2) == n &&
              parts.size(0) == slots && parts.size(2) == 4, "lora_add: the stacks do not fit x and out");
  const int64_t num_rows = out.size(0), indexed = row_index.numel();
  const int64_t* group_data = groups.data_ptr<int64_t>();
  const int64_t* row_data = row_index.data_ptr<int64_t>();
  const int64_t* part_data = parts.data_ptr<int64_t>();
  std::vector<int64_t> tiles;  // (offset in row_index, rows, slot): each group cut in tiles of kTileRows rows
  for (int64_t g = 0; g < groups.size(0); ++g) {
    const int64_t* group = group_data + 3 * g;
    TORCH_CHECK(group[0] >= 0 && group[1] >= 0 && group[0] + group[1] <= indexed && group[2] >= 0 &&
                group[2] < slots, "lora_add: group ", g, " is out of range");
    for (int64_t r = 0; r < group[1]; r += kTileRows) {
      tiles.insert(tiles.end(), {group[0] + r, std::min(kTileRows, group[1] - r), group[2]});
    }
  }
  std::vector<bool> seen(num_rows, false);  // a row in two tiles would be written by two threads at once
  for (int64_t i = 0; i < indexed; ++i) {
    TORCH_CHECK(row_data[i] >= 0 && row_data[i] < num_rows, "lora_add: row ", row_data[i], " is out of range");
    TORCH_CHECK(!seen[row_data[i]], "lora_add: row ", row_data[i], " is listed twice");
    seen[row_data[i]] = true;
  }
  for (int64_t i = 0; i < slots * num_parts; ++i) {
    const int64_t* p = part_data + 4 * i;
    TORCH_CHECK(0 <= p[0] && p[0] <= p[1] && p[1] <= n && 0 <= p[2] && p[2] <= p[3] && p[3] <= rank,
                "lora_add: part ", i, " is out of range");
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) / 3;
  const auto run = [&](const auto* x_data, auto* out_data, const auto* a_data, const auto* b_data) {
    at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xt(kTileRows * in), t(kTileRows * rank);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t* tile = tiles.data() + 3 * i;
        const int64_t* rows = row_data + tile[0];
        const int64_t count = tile[1], slot = tile[2];
        load_rows(x_data, in, rows, count, xt.data());
        shrink(xt.data(), in, a_data + slot * in * rank, rank, t.data());
        for (int64_t p = 0; p < num_parts; ++p) {
          const int64_t* part = part_data + 4 * (slot * num_parts + p);
          if (part[3] > part[2] && part[1] > part[0]) {
            expand(t.data(), rank, count, b_data + slot * rank * n, n, part[0], part[1], part[2], part[3], out_data,
                   rows);
          }
        }
      }
    });
  };
  const auto with_weights = [&](const auto* x_data, auto* out_data) {
    if (a.scalar_type() == at::kFloat) {
      run(x_data, out_data, a.data_ptr<float>(), b.data_ptr<float>());
    } else {
      run(x_data, out_data, a.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>());
    }
  };
  if (x.scalar_type() == at::kFloat) {
    with_weights(x.data_ptr<float>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "lora_add: float32 or bf16 rows, not ", x.scalar_type());
    with_weights(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
}
