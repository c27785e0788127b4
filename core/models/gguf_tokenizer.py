"""A correct Hugging Face tokenizer for a GGUF file.

transformers (5.5) picks the GGUF tokenizer converter by model architecture, so a Llama-architecture
model with a GPT-2 style BPE vocabulary (SmolLM2) gets a SentencePiece-style tokenizer: spaces
decode wrong, a BOS is added that the file says not to add, and the EOS is wrong. Here the converter is
chosen by the file's own ``tokenizer.ggml.model``, and the special tokens come from its metadata.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.models.gguf_file import open_gguf

logger = logging.getLogger("pagedllm.gguf")

# llama.cpp pre-tokenizer names whose regex is "each digit alone", then the GPT-2 split.
_SPLIT_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2_PRE = {None, "default", "gpt-2", "gpt2"}


def _gguf_fields(path: Path, *keys: str) -> list:
    fields = open_gguf(path).fields
    return [fields.get(k) for k in keys]


def tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(path), return_tensors=False)
    vocab = meta["tokenizer"]
    config = meta["tokenizer_config"]
    if vocab.get("tokenizer_type") != "gpt2":
        # SentencePiece-style vocabularies: transformers' own converter handles these.
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    from tokenizers import pre_tokenizers, processors
    from transformers.integrations.ggml import GGUFGPTConverter

    backend = GGUFGPTConverter(dict(vocab)).converted()
    pre, add_bos = _gguf_fields(path, "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token")
    if pre in _SPLIT_DIGITS_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    elif pre not in _GPT2_PRE:
        logger.warning("GGUF pre-tokenizer %r is approximated by the GPT-2 split; rare texts may tokenize "
                       "differently from llama.cpp", pre)
    tokens = vocab["tokens"]

    def token(key: str) -> str | None:
        idx = config.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = token("bos_token_id")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, config["bos_token_id"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("eos_token_id"),
        unk_token=token("unk_token_id"),
        pad_token=token("pad_token_id"),
        chat_template=config.get("chat_template"),
        clean_up_tokenization_spaces=False,
    )
