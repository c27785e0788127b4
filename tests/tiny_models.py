"""Tiny random models and a tiny tokenizer, built locally (nothing comes from a model hub).

Weights are drawn with a larger spread than usual so that logits are not flat: greedy choices then
depend on the context, and a wrong attention shows up as different tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Numbers like 12345 and 2026 appear in text, as do émigrés, naïve cafés and 😀 emojis.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching schedules decodes first, then prompt chunks, under a token budget.",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VOCAB_SIZE = 384


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out_dir)
    return fast


def _config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.25, eos_token_id=0, bos_token_id=1, pad_token_id=0)
    if arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=16)
    if arch == "mistral":
        # A short window, so prompts + outputs here run past it.
        return transformers.MistralConfig(**common, head_dim=16, sliding_window=48)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    if arch == "phi3":
        return transformers.Phi3Config(**common, sliding_window=None)
    if arch == "gemma":
        return transformers.GemmaConfig(**common, head_dim=16)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                       initializer_range=0.25, eos_token_id=0, bos_token_id=1)
    if arch == "opt":
        return transformers.OPTConfig(vocab_size=VOCAB_SIZE, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
                                      init_std=0.5, eos_token_id=0, bos_token_id=1, pad_token_id=0)
    raise ValueError(arch)


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2")  # what the cpu backend runs
ALL_ARCHITECTURES = ARCHITECTURES


def build_model(arch: str, out_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(zlib.crc32(arch.encode()))
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def kv_bytes_per_block(arch: str, block_size: int = 16, element_size: int = 4) -> int:
    c = _config(arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * block_size * head_dim * element_size


ORACLE_CACHE_ENV = "PAGEDLLM_TEST_ORACLE_CACHE"


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers' own generate, one prompt at a time (no padding), float32, no EOS stop.

    With PAGEDLLM_TEST_ORACLE_CACHE set (``make test`` sets it), answers are kept there by the hash of the model's
    files, the prompts and transformers' version: the second pass, as the other kind of CPU, checks the backend
    against the same answers without computing them again."""
    cache = os.environ.get(ORACLE_CACHE_ENV)
    if not cache:
        return _hf_greedy(model_dir, prompts, max_new_tokens)
    import transformers

    digest = hashlib.sha256(json.dumps([prompts, max_new_tokens, transformers.__version__]).encode())
    for path in sorted(Path(model_dir).iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    entry = Path(cache) / f"{digest.hexdigest()}.json"
    if entry.is_file():
        return json.loads(entry.read_text())
    outs = _hf_greedy(model_dir, prompts, max_new_tokens)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(outs))
    tmp.rename(entry)
    return outs


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    return greedy_generate(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), prompts,
                           max_new_tokens)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A transformers (or peft) model's greedy continuations, one prompt at a time, the end token a token like the
    others (as ignore_eos)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs


def random_prompts(lengths, seed=0, low=3):
    rng = random.Random(seed)
    return [[rng.randrange(low, VOCAB_SIZE) for _ in range(n)] for n in lengths]
