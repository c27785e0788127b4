"""LoRA adapters made with peft for the tests (random, scaled up so that each one changes the greedy text), and
transformers + peft's greedy output as the oracle."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_models import greedy_generate

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, targets=ALL_PROJECTIONS) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.save_pretrained(out)
    return out


def peft_greedy(model_dir: Path, adapter: Path | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """transformers' generate with the adapter applied by peft (None: the base model), one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return greedy_generate(model, prompts, max_new_tokens)
