// The backend's C++ extension: one Python module over the kernels in this folder.
// torch's pybind11 casters for tensors, not <torch/extension.h>: the whole C++ frontend took most of a build's time.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>
#include <tuple>

void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, c10::optional<at::Tensor> key_scale,
                            c10::optional<at::Tensor> key_min, c10::optional<at::Tensor> value_scale,
                            c10::optional<at::Tensor> value_min, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t window,
                            c10::optional<at::Tensor> new_keys, c10::optional<at::Tensor> new_values,
                            c10::optional<at::Tensor> slots, int64_t shared_blocks, bool split_runs);
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, c10::optional<at::Tensor> key_scale,
                             c10::optional<at::Tensor> key_min, c10::optional<at::Tensor> value_scale,
                             c10::optional<at::Tensor> value_min, at::Tensor block_table,
                             at::Tensor past_lens, at::Tensor q_starts, at::Tensor q_lens, double scale,
                             int64_t window);
void store_kv_rows(at::Tensor key_cache, at::Tensor value_cache, at::Tensor keys, at::Tensor values,
                   at::Tensor slots);
void store_kv_u8(at::Tensor key_cache, at::Tensor key_scale, at::Tensor key_min, at::Tensor value_cache,
                 at::Tensor value_scale, at::Tensor value_min, at::Tensor keys, at::Tensor values, at::Tensor slots);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor h, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate, at::Tensor up, c10::optional<at::Tensor> scales);
void rotary_embedding(at::Tensor query, at::Tensor key, at::Tensor cos, at::Tensor sin, int64_t head_size);
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus);
bool linear_bf16_available();
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t out_features, bool float_output);
at::Tensor linear_silu_and_mul_bf16(const at::Tensor& x, const at::Tensor& packed,
                                       const c10::optional<at::Tensor>& bias, int64_t width);
bool quantized_linear_int8_simd();
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                            const at::Tensor& offsets,
                            const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                            int64_t out_features,
                            const c10::optional<at::Tensor>& bias, bool float_output, int64_t activation_bits);
at::Tensor quantized_linear_tiles_f32(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                      const at::Tensor& offsets,
                                      const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                                      int64_t out_features, const c10::optional<at::Tensor>& bias,
                                      bool float_output);
bool quantized_linear_bf16_available();
at::Tensor quantized_linear_bf16(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                                 const at::Tensor& offsets,
                                 const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                            int64_t out_features,
                                 const c10::optional<at::Tensor>& bias, bool float_output);
at::Tensor quantized_linear_silu_and_mul_bf16(const at::Tensor& x, const at::Tensor& values,
                                              const at::Tensor& scales, const at::Tensor& offsets,
                                              const at::Tensor& multipliers, int64_t bits,
                                              int64_t group, int64_t zero,
                                              const c10::optional<at::Tensor>& bias, int64_t width);
at::Tensor quantized_gemv_bf16(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                               const at::Tensor& offsets,
                               const at::Tensor& multipliers, int64_t bits, int64_t group, int64_t zero,
                            int64_t out_features,
                               const c10::optional<at::Tensor>& bias, bool float_output);
at::Tensor dequantize_weight(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                             const at::Tensor& multipliers,
                             int64_t bits, int64_t group, int64_t zero, int64_t out_features, bool bf16);
at::Tensor dequantize_rows(const at::Tensor& values, const at::Tensor& scales, const at::Tensor& offsets,
                           const at::Tensor& multipliers,
                           int64_t bits, int64_t group, int64_t zero, int64_t out_features, const at::Tensor& ids,
                           bool bf16);
std::tuple<at::Tensor, at::Tensor> quantize_rows_uint8(const at::Tensor& x);
void scale_rows(at::Tensor& out, const at::Tensor& scales, const c10::optional<at::Tensor>& bias);
void lora_add(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& parts,
              const at::Tensor& row_index, const at::Tensor& groups);

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"),
        py::arg("key_min"), py::arg("value_scale"), py::arg("value_min"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window"), py::arg("new_keys") = py::none(), py::arg("new_values") = py::none(),
        py::arg("slots") = py::none(), py::arg("shared_blocks") = 0, py::arg("split_runs") = true);
  m.def("paged_prefill_attention", &paged_prefill_attention, "prompt chunks' attention over a paged KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("key_scale"),
        py::arg("key_min"), py::arg("value_scale"), py::arg("value_min"), py::arg("block_table"),
        py::arg("past_lens"), py::arg("q_starts"), py::arg("q_lens"), py::arg("scale"), py::arg("window"));
  m.def("store_kv_rows", &store_kv_rows, "tokens' keys and values into their cache slots", py::arg("key_cache"),
        py::arg("value_cache"), py::arg("keys"), py::arg("values"), py::arg("slots"));
  m.def("store_kv_u8", &store_kv_u8, "tokens' keys and values into a u8 cache (keys per block and channel, values "
        "per token)", py::arg("key_cache"), py::arg("key_scale"), py::arg("key_min"), py::arg("value_cache"),
        py::arg("value_scale"), py::arg("value_min"), py::arg("keys"), py::arg("values"), py::arg("slots"));
  m.def("rms_norm", &rms_norm, "Llama-style RMSNorm over the last dimension");
  m.def("add_rms_norm", &add_rms_norm, "residual += h, then Llama-style RMSNorm of the residual",
        py::arg("h"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate * s) * (up * s), elementwise (s: a scale per row, or 1)",
        py::arg("gate"), py::arg("up"), py::arg("scales") = py::none());
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE applied in place to query and key rows",
        py::arg("query"), py::arg("key"), py::arg("cos"), py::arg("sin"), py::arg("head_size"));
  m.def("linear_bf16_available", &linear_bf16_available, "whether this build has the bf16 brgemm linear");
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16, "a bf16 [out, in] weight in linear_bf16's layout");
  m.def("linear_bf16", &linear_bf16, "x @ weight.T + bias over a weight from pack_linear_weight_bf16",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("float_output") = false);
  m.def("linear_silu_and_mul_bf16", &linear_silu_and_mul_bf16,
        "silu(gate) * up of x's gate and up projections, over a weight packed with their blocks alternating",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("width"));
  m.def("quantized_linear_int8_simd", &quantized_linear_int8_simd,
        "whether the int8 dot products use AVX512_VNNI (else AVX2's vpmaddubsw or scalar code)");
  m.def("quantized_linear", &quantized_linear,
        "x @ W.T + bias over a block-quantized weight in panels (w = scale * u + offset)",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("out_features"), py::arg("bias"), py::arg("float_output") = false,
        py::arg("activation_bits"));
  m.def("quantized_linear_tiles_f32", &quantized_linear_tiles_f32,
        "x @ W.T + bias for many rows over a block-quantized weight, dequantized to float32 blocks for the GEMM",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("out_features"), py::arg("bias"), py::arg("float_output") = false);
  m.def("quantized_linear_bf16_available", &quantized_linear_bf16_available,
        "whether this build has quantized_linear_bf16 (AVX512_BF16)");
  m.def("quantized_linear_bf16", &quantized_linear_bf16,
        "bf16 x @ W.T + bias over a block-quantized weight, dequantized to bf16 tiles for brgemm",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("out_features"), py::arg("bias"), py::arg("float_output") = false);
  m.def("quantized_linear_silu_and_mul_bf16", &quantized_linear_silu_and_mul_bf16,
        "silu(gate) * up of x's gate and up projections over a quantized [gate; up] weight, in bf16 tiles",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("bias"), py::arg("width"));
  m.def("quantized_gemv_bf16", &quantized_gemv_bf16,
        "bf16 x @ W.T + bias for a few rows over a block-quantized weight, 16 columns per vdpbf16ps",
        py::arg("x"), py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("out_features"), py::arg("bias"), py::arg("float_output") = false);
  m.def("dequantize_weight", &dequantize_weight, "a block-quantized weight as a dense [N, K] float32 or bf16 tensor",
        py::arg("values"), py::arg("scales"), py::arg("offsets"),
        py::arg("multipliers"), py::arg("bits"), py::arg("group"),
        py::arg("zero"), py::arg("out_features"), py::arg("bf16") = false);
  m.def("dequantize_rows", &dequantize_rows, "rows ids of a block-quantized weight as dense float32 or bf16 rows "
        "(an embedding lookup in a tied head's weight)");
  m.def("quantize_rows_uint8", &quantize_rows_uint8,
        "rows as int8 offset by 128 (uint8) and a float32 scale per row (max |x| / 127)");
  m.def("scale_rows", &scale_rows, "out[r] = out[r] * scales[r] + bias, in place", py::arg("out"),
        py::arg("scales"), py::arg("bias") = py::none());
  m.def("lora_add", &lora_add, "out[row] += (x[row] @ a[slot]) @ b[slot] for each adapter's rows, in place",
        py::arg("out"), py::arg("x"), py::arg("a"), py::arg("b"), py::arg("parts"), py::arg("row_index"),
        py::arg("groups"));
  m.def("bind_threads", &bind_threads, "pin the calling thread's OpenMP threads, one per CPU");
}
