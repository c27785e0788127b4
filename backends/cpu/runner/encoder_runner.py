"""The pooling runner's model (``--runner pooling``): transformers' base model of the folder (an encoder such as
BERT, or a decoder's body without its LM head), run on whole prompts. Each step's prompts go in sorted by length, in
groups padded to their longest (an attention mask keeps each prompt to itself), and come back as the flattened last
hidden states the core pools. Nothing is cached: a pooling request needs one forward pass."""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagedllm.backend import ModelInfo
from pagedllm.backends.cpu.runner.threads import ThreadBinder
from pagedllm.batch import EncodeBatch
from pagedllm.errors import UnsupportedModelError

logger = logging.getLogger("pagedllm.cpu")
# A group of prompts is padded to its longest; a new group starts where padding would pass this share of the work.
MAX_PADDING = 0.25
# model types that attend causally (their last token has seen the whole prompt: LAST pooling by default)
_DECODERS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "gpt2", "opt"})


class EncoderRunner:
    def __init__(self, model_dir: str, dtype: torch.dtype, binder: ThreadBinder, trust_remote_code: bool) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.binder = binder
        self.trust_remote_code = trust_remote_code
        self.model = None

    def load(self) -> ModelInfo:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(self.model_dir, trust_remote_code=self.trust_remote_code)
        text = config.get_text_config()
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(f"{config.model_type}: encoder-decoder models have no pooling runner here")
        try:
            self.model = AutoModel.from_pretrained(self.model_dir, dtype=self.dtype, attn_implementation="sdpa",
                                                   trust_remote_code=self.trust_remote_code).eval()
        except ValueError as exc:
            raise UnsupportedModelError(f"transformers has no base model for {config.model_type!r}: {exc}") from None
        decoder = config.model_type in _DECODERS or any(a.endswith("ForCausalLM") for a in config.architectures or [])
        heads = text.num_attention_heads
        logger.info("pooling runner: %s (%s, %d layers, hidden size %d) through transformers' %s, sdpa attention",
                    config.model_type, "a decoder" if decoder else "an encoder", text.num_hidden_layers,
                    text.hidden_size, type(self.model).__name__)
        return ModelInfo(architecture=config.model_type, vocab_size=text.vocab_size,
                         num_layers=text.num_hidden_layers,
                         num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                         head_size=getattr(text, "head_dim", None) or text.hidden_size // heads,
                         max_model_len=text.max_position_embeddings, dtype=str(self.dtype).removeprefix("torch."),
                         hidden_size=text.hidden_size, decoder=decoder)

    @torch.inference_mode()
    def encode(self, batch: EncodeBatch) -> torch.Tensor:
        self.binder.ensure_bound()
        starts = batch.query_start_loc
        lengths = np.diff(starts)
        out = torch.empty(len(batch.input_ids), self.model.config.get_text_config().hidden_size, dtype=self.dtype)
        for group in _groups(lengths):
            width = int(lengths[group].max())
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for row, seq in enumerate(group):
                n = int(lengths[seq])
                ids[row, :n] = torch.from_numpy(batch.input_ids[starts[seq]:starts[seq] + n])
                mask[row, :n] = 1
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, seq in enumerate(group):
                out[starts[seq]:starts[seq + 1]] = hidden[row, :int(lengths[seq])]
        return out


def _groups(lengths: np.ndarray) -> list[np.ndarray]:
    """The sequences sorted by length, cut into groups whose padding stays under MAX_PADDING of their tokens."""
    order = np.argsort(lengths, kind="stable")
    groups, current, tokens = [], [], 0
    for seq in order:
        n = int(lengths[seq])  # the longest so far: sorted ascending
        if current and n * (len(current) + 1) > (1 + MAX_PADDING) * (tokens + n):
            groups.append(np.array(current))
            current, tokens = [], 0
        current.append(seq)
        tokens += n
    if current:
        groups.append(np.array(current))
    return groups
