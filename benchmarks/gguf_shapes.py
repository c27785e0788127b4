"""GGUF files of a shaped model (model_shapes.py), so that llama.cpp and pagedllm read the same quantized bits.

The shaped model's Hugging Face folder (random bf16 weights) is written as a BF16 GGUF file with the ``gguf``
package (norms in float32, as llama.cpp wants them): llama.cpp's tensor names, its q/k row order, and SmolLM2's
tokenizer (the shaped models' tokenizer) padded
with unused tokens up to the model's vocabulary. llama.cpp's own quantizer (``llama_model_quantize``, run in the
llama.cpp venv of llama_cpp_env.py) makes the Q8_0, Q4_0, Q4_K_M and Q5_K_M files from it. All are cached beside the
shaped model. Name ``smollm2`` is the default model itself (its Q4_1 file's weights as transformers dequantizes them,
then the same two steps): a real model in each format, for precision.py.

    python benchmarks/gguf_shapes.py llama-1b Q4_0      # prints the file's path, making it if needed
    python benchmarks/gguf_shapes.py smollm2 Q4_K_M
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import llama_cpp_env
import model_shapes

# llama.cpp's file type of each quantization its quantizer makes here (LLAMA_FTYPE_MOSTLY_*)
FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15, "Q5_K_M": 17}
DEFAULT_MODEL = "smollm2"  # shaped_gguf's name for the default model itself


def shaped_gguf(name: str, qtype: str, cache: Path) -> Path:
    """The GGUF file of shaped model ``name`` (or of the default model: DEFAULT_MODEL) in ``qtype`` (BF16, Q8_0,
    Q4_0, Q4_K_M or Q5_K_M), made on first use."""
    from pagedllm.models.source import default_model_path, gguf_metadata_folder, resolve_model

    if name == DEFAULT_MODEL:
        folder, out_dir = resolve_model(None).hf_dir, cache / "requantized"
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        folder = out_dir = model_shapes.shaped_model(name, gguf_metadata_folder(default_model_path()), cache)
    bf16 = out_dir / f"{name}-BF16-v2.gguf"  # v2: float32 norms
    if not bf16.is_file():
        write_bf16_gguf(folder, default_model_path(), bf16)
    if qtype == "BF16":
        return bf16
    if qtype not in FILE_TYPES:
        raise SystemExit(f"unknown GGUF type {qtype!r}: choose from BF16, {', '.join(FILE_TYPES)}")
    out = out_dir / f"{name}-{qtype}-v2.gguf"
    if not out.is_file():
        quantize_with_llama_cpp(bf16, out, FILE_TYPES[qtype])
    return out


def _permute_for_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k rows in llama.cpp's order (its rotary pairs interleaved within each head)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_bf16_gguf(folder: Path, tokenizer_gguf: Path, out: Path) -> None:
    import gguf
    import torch
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    vocab, heads, kv_heads = config["vocab_size"], config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out) + ".tmp", "llama")
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _copy_tokenizer(gguf.GGUFReader(str(tokenizer_gguf)), writer, vocab)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm":
                 "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue
            tensor = f.get_tensor(key)
            if key in names:
                gguf_name = names[key]
            else:
                parts = key.split(".")  # model.layers.N.<module...>.weight
                gguf_name = f"blk.{parts[2]}.{per_layer['.'.join(parts[3:-1])]}.weight"
            if tensor.dim() == 1:  # norms: llama.cpp's kernels take them in float32 only
                writer.add_tensor(gguf_name, tensor.float().numpy())
                continue
            bits = tensor.to(torch.bfloat16).view(torch.int16).numpy()
            if gguf_name.endswith("attn_q.weight"):
                bits = _permute_for_llama_cpp(bits, heads)
            elif gguf_name.endswith("attn_k.weight"):
                bits = _permute_for_llama_cpp(bits, kv_heads)
            writer.add_tensor(gguf_name, np.ascontiguousarray(bits).view(np.uint16), raw_shape=bits.shape,
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    Path(str(out) + ".tmp").rename(out)


def _copy_tokenizer(reader, writer, vocab: int) -> None:
    """SmolLM2's tokenizer fields, its token list padded with unused tokens to the model's vocabulary."""
    import gguf

    fields = reader.fields

    def value(key: str):
        field = fields[key]
        return field.contents()

    tokens = value("tokenizer.ggml.tokens")
    types = value("tokenizer.ggml.token_type")
    pad = vocab - len(tokens)
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(pad)])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(value("tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(value("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(value("tokenizer.ggml.add_bos_token"))
    writer.add_add_space_prefix(value("tokenizer.ggml.add_space_prefix"))
    writer.add_chat_template(value("tokenizer.chat_template"))


def quantize_with_llama_cpp(source: Path, out: Path, file_type: int) -> None:
    venv = llama_cpp_env.default_venv_dir()
    llama_cpp_env.ensure_venv(venv)
    code = ("import sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); "
            "p.nthread = 0; sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    tmp = Path(str(out) + ".tmp")
    subprocess.run([str(llama_cpp_env.venv_python(venv)), "-c", code, str(source), str(tmp), str(file_type)],
                   check=True)
    tmp.rename(out)


def main() -> None:
    from pagedllm.models.source import cache_dir

    name, qtype = sys.argv[1:3]
    print(shaped_gguf(name, qtype, cache_dir()))


if __name__ == "__main__":
    main()
