// RMSNorm in one pass per row, as transformers' Llama-family RMSNorm computes it: in float32,
// x * rsqrt(mean(x^2) + eps), rounded to the input's dtype, then times the weight (torch runs that as seven ops).
// The fused form first adds a layer's output into the residual stream in place (vLLM's fused_add_rms_norm), so the
// stream is read once; the stream may be float32 under bf16 weights.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace {

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// The row's values as float32 after rounding to the stream's dtype (what torch's add in that dtype yields).
template <typename stream_t>
inline float round_to(float x) {
  return static_cast<float>(static_cast<stream_t>(x));
}

// out = weight * round_to<x_t>(x * inv), the product rounded to out_t.
template <typename x_t, typename w_t, typename out_t>
void scale_row(const x_t* x, const w_t* weight, out_t* out, int64_t dim, float inv) {
  int64_t d = 0;
#if defined(PAGEDLLM_VEC)
  using pagedllm::Vec;
  const Vec vinv = Vec::broadcast(inv);
  for (; d + Vec::size <= dim; d += Vec::size) {
    Vec normed = Vec::load(x + d) * vinv;
    if constexpr (std::is_same<x_t, at::BFloat16>::value) normed = normed.rounded_to_bf16();
    (Vec::load(weight + d) * normed).store(out + d);
  }
#endif
  for (; d < dim; ++d) out[d] = static_cast<out_t>(widen(weight[d]) * round_to<x_t>(widen(x[d]) * inv));
}

template <typename T>
float sum_of_squares(const T* x, int64_t dim) {
  float squares = 0.f;
  int64_t d = 0;
#if defined(PAGEDLLM_VEC)
  using pagedllm::Vec;
  Vec acc = Vec::zero();
  for (; d + Vec::size <= dim; d += Vec::size) {
    const Vec v = Vec::load(x + d);
    acc = Vec::fma(v, v, acc);
  }
  squares = acc.sum();
#endif
  for (; d < dim; ++d) squares += widen(x[d]) * widen(x[d]);
  return squares;
}

template <typename x_t, typename w_t, typename out_t>
void rms_norm_rows(const x_t* x, const w_t* weight, out_t* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = 1.f / std::sqrt(sum_of_squares(x + r * dim, dim) / static_cast<float>(dim) + eps);
      scale_row(x + r * dim, weight, out + r * dim, dim, inv);
    }
  });
}

// residual += h (rounded to the stream's dtype), then out = rms_norm(residual).
template <typename h_t, typename stream_t, typename w_t>
void add_rms_norm_rows(const h_t* h, stream_t* residual, const w_t* weight, w_t* out, int64_t rows, int64_t dim,
                       float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      stream_t* res = residual + r * dim;
      const h_t* hr = h + r * dim;
      int64_t d = 0;
#if defined(PAGEDLLM_VEC)
      using pagedllm::Vec;
      for (; d + Vec::size <= dim; d += Vec::size) (Vec::load(res + d) + Vec::load(hr + d)).store(res + d);
#endif
      for (; d < dim; ++d) res[d] = static_cast<stream_t>(widen(res[d]) + widen(hr[d]));
      const float inv = 1.f / std::sqrt(sum_of_squares(res, dim) / static_cast<float>(dim) + eps);
      scale_row(res, weight, out + r * dim, dim, inv);
    }
  });
}

int64_t check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), name, ": contiguous input and weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.numel() == dim, name, ": weight size");
  for (const at::Tensor* t : {&x, &weight})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, name,
                ": float32 or bfloat16, got ", t->scalar_type());
  return dim;
}

template <typename F>
void with_type(at::ScalarType type, F&& f) {
  if (type == at::kFloat)
    f(float{});
  else
    f(at::BFloat16{});
}

}  // namespace

// x [..., dim] contiguous, weight [dim]; float32 or bfloat16 each. The result has the weight's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  const int64_t dim = check_rows(x, weight, "rms_norm");
  auto out = x.new_empty(x.sizes(), x.options().dtype(weight.scalar_type()));
  const int64_t rows = dim ? x.numel() / dim : 0;
  with_type(x.scalar_type(), [&](auto x_tag) {
    with_type(weight.scalar_type(), [&](auto w_tag) {
      using x_t = decltype(x_tag);
      using w_t = decltype(w_tag);
      rms_norm_rows(x.data_ptr<x_t>(), weight.data_ptr<w_t>(), out.data_ptr<w_t>(), rows, dim,
                    static_cast<float>(eps));
    });
  });
  return out;
}

// residual [..., dim] (updated in place: residual += h) and h of the same shape; returns rms_norm(residual) in the
// weight's dtype. h and weight share a dtype; the residual stream is float32 or that dtype.
at::Tensor add_rms_norm(at::Tensor h, at::Tensor residual, at::Tensor weight, double eps) {
  const int64_t dim = check_rows(residual, weight, "add_rms_norm");
  TORCH_CHECK(h.is_contiguous() && h.sizes() == residual.sizes() && h.scalar_type() == weight.scalar_type(),
              "add_rms_norm: h must be contiguous, shaped as the residual, in the weight's dtype");
  auto out = h.new_empty(h.sizes());
  const int64_t rows = dim ? h.numel() / dim : 0;
  with_type(residual.scalar_type(), [&](auto s_tag) {
    with_type(weight.scalar_type(), [&](auto w_tag) {
      using s_t = decltype(s_tag);
      using w_t = decltype(w_tag);
      add_rms_norm_rows(h.data_ptr<w_t>(), residual.data_ptr<s_t>(), weight.data_ptr<w_t>(), out.data_ptr<w_t>(),
                        rows, dim, static_cast<float>(eps));
    });
  });
  return out;
}
