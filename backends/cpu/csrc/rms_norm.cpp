// RMSNorm in one pass per row, as transformers' Llama-family RMSNorm computes it: in float32,
// x * rsqrt(mean(x^2) + eps), cast back to the input dtype, then times the weight; torch runs that as seven ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * dim;
      scalar_t* outr = out + r * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = static_cast<float>(xr[d]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t d = 0; d < dim; ++d)
        outr[d] = static_cast<scalar_t>(static_cast<float>(weight[d]) *
                                        static_cast<float>(static_cast<scalar_t>(static_cast<float>(xr[d]) * inv)));
    }
  });
}

}  // namespace

// x [..., dim] contiguous float32 or bfloat16, weight [dim] of the same dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous input and weight");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: input and weight dtypes differ");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, "rms_norm: weight size");
  auto out = at::empty_like(x);
  const int64_t rows = dim ? x.numel() / dim : 0;
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_rows<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, dim,
                           static_cast<float>(eps));
      break;
    case at::kBFloat16:
      rms_norm_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                  out.data_ptr<at::BFloat16>(), rows, dim, static_cast<float>(eps));
      break;
    default:
      TORCH_CHECK(false, "rms_norm: float32 or bfloat16, got ", x.scalar_type());
  }
  return out;
}
