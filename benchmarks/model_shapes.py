"""Models of a real model's shape with random weights, for benchmarks where SmolLM2 is too small to show the cost of
memory traffic: the same GEMMs and KV cache traffic, meaningless text. Built once into pagedllm's cache folder, as a
Hugging Face folder every engine reads; the tokenizer is SmolLM2's (its ids are all below the vocabulary size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# name -> the config fields of the real model (Llama-3.2-1B: 1.24B parameters, 16 layers, GQA 32/8, head size 64;
# Qwen2.5-0.5B: 0.49B, 24 layers, GQA 14/2, head size 64, the smallest common model whose heads split in two; its
# q/k/v biases are left out, a Llama layer of its shape)
SHAPES = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rope_theta": 500000.0,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 4096},
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def shaped_model(name: str, tokenizer_dir: Path, cache: Path) -> Path:
    """The folder of the random model ``name`` (made on first use, bf16 weights, seed 0)."""
    fields = SHAPES[name]
    out = cache / "shaped-models" / f"{name}-random"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    special = json.loads((tokenizer_dir / "config.json").read_text())
    config = LlamaConfig(**fields, bos_token_id=special.get("bos_token_id"), eos_token_id=special.get("eos_token_id"))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialized in bf16 directly: half the memory of a float32 init
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(tmp)
    for file in _TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, tmp / file)
    tmp.rename(out)
    return out
