// A blocked float32 transpose: torch's strided copy of a transposed [out_features, rows] product runs 4-8x
// slower (see weight_major.py, which needs one per linear layer per decode step).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {
#if defined(__AVX2__)
// out[c * ld_out + r] = in[r * ld_in + c] for an 8 x 8 tile.
inline void tile8x8(const float* in, int64_t ld_in, float* out, int64_t ld_out) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ld_in);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ld_out, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ld_out, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif
}  // namespace

// src [rows, cols] float32 contiguous -> [cols, rows] contiguous.
at::Tensor transpose2d(at::Tensor src) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && src.scalar_type() == at::kFloat, "float32 contiguous 2-d");
  const int64_t rows = src.size(0), cols = src.size(1);
  auto out = at::empty({cols, rows}, src.options());
  const float* in = src.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Parallel over bands of 8 source rows; each band writes an 8-wide column strip of the output.
  const int64_t bands = (rows + 7) / 8;
  at::parallel_for(0, bands, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * 8;
      int64_t c = 0;
#if defined(__AVX2__)
      if (r + 8 <= rows)
        for (; c + 8 <= cols; c += 8) tile8x8(in + r * cols + c, cols, o + c * rows + r, rows);
#endif
      for (int64_t rr = r; rr < std::min(r + 8, rows); ++rr)
        for (int64_t cc = c; cc < cols; ++cc) o[cc * rows + rr] = in[rr * cols + cc];
    }
  });
  return out;
}
