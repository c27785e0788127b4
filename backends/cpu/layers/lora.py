"""LoRA adapters on the decoder layers' projections, several in one batch (as punica and vLLM's LoRA layers do):
each projection runs its base GEMM once over every row, then each adapter in the step adds its low-rank product
``scale * (x @ A^T) @ B^T`` to its own requests' rows only. Adapters are in peft's format and target any of q, k,
v, o, gate, up and down; where those are fused into one GEMM (q/k/v, gate/up) each adds to its slice of the output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class StepAdapters:
    """The current step's rows of each adapter, shared by every LoRA layer of a model: [(lora id, token rows)]."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set(self, lora_ids, query_start_loc) -> None:
        """From a batch's ``lora_ids`` (per sequence, 0 for none) and ``query_start_loc``."""
        self.groups = []
        if lora_ids is None:
            return
        starts = query_start_loc.tolist()
        rows: dict[int, list[int]] = {}
        for seq, lora_id in enumerate(lora_ids.tolist()):
            if lora_id:
                rows.setdefault(lora_id, []).extend(range(starts[seq], starts[seq + 1]))
        self.groups = [(lora_id, torch.tensor(r, dtype=torch.long)) for lora_id, r in rows.items()]


class LoRALinear(torch.nn.Module):
    """A projection (or a fused one) and the adapters' low-rank products on the rows that asked for them.
    ``slices`` maps each projection it computes to its columns of the output."""

    def __init__(self, base: torch.nn.Module, slices: dict[str, tuple[int, int]], step: StepAdapters) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.step = step
        # lora id -> [(first column, end column, A [rank, in], B [columns, rank], scale)]
        self.adapters: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.forward(x)
        if not self.step.groups or not self.adapters:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for lora_id, rows in self.step.groups:
            parts = self.adapters.get(lora_id)
            if not parts:
                continue
            xs = flat_x.index_select(0, rows)
            for start, end, a, b, scale in parts:
                delta = (xs @ a.t()) @ b.t() * scale
                flat_out[:, start:end].index_add_(0, rows, delta.to(out.dtype))
        return out


def wrap_projections(model: torch.nn.Module, step: StepAdapters) -> dict[str, tuple[LoRALinear, int, int]]:
    """Wrap each decoder layer's projections (nn.Linear still: they are packed inside the wrappers afterwards);
    returns, for each projection as peft names it
    (``model.layers.3.self_attn.q_proj``), its wrapper and columns."""
    targets: dict[str, tuple[LoRALinear, int, int]] = {}
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    for index, layer in enumerate(decoder.layers):
        for part_name in ("self_attn", "mlp"):
            part = getattr(layer, part_name)
            for name in list(_FUSED) + list(PROJECTIONS):
                base = getattr(part, name, None)
                if base is None or isinstance(base, LoRALinear):
                    continue
                if name in _FUSED:
                    widths = getattr(part, f"{name}_widths")
                    bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
                    slices = {p: (bounds[i], bounds[i + 1]) for i, p in enumerate(_FUSED[name])}
                else:
                    slices = {name: (0, base.out_features)}
                wrapper = LoRALinear(base, slices, step)
                setattr(part, name, wrapper)
                for projection, (start, end) in slices.items():
                    targets[f"{prefix}.layers.{index}.{part_name}.{projection}"] = (wrapper, start, end)
    return targets


def load_adapter(path: str, targets: dict[str, tuple[LoRALinear, int, int]], max_rank: int,
                 dtype: torch.dtype) -> list[tuple[LoRALinear, tuple]]:
    """Read a peft adapter; returns the (layer, part) pairs to attach. ValueError for what cannot run here."""
    folder = Path(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {config.get('peft_type')!r}: only LORA adapters run here")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise ValueError(f"its rank {rank} is above --max-lora-rank {max_rank}")
    if config.get("use_dora"):
        raise ValueError("DoRA adapters (use_dora) are not supported")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    files = [folder / "adapter_model.safetensors"]
    if not files[0].is_file():
        raise ValueError("no adapter_model.safetensors in the folder")
    weights = load_file(str(files[0]))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        module, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"tensor {key}: only lora_A and lora_B weights are supported (no embeddings, biases or "
                             f"modules to save)")
        parts.setdefault(module, {})[kind[0]] = tensor
    attach = []
    for module, ab in parts.items():
        if module not in targets:
            raise ValueError(f"it adapts {module}, which is not one of the decoder layers' projections "
                             f"({', '.join(PROJECTIONS)})")
        wrapper, start, end = targets[module]
        a, b = ab["A"].to(dtype).contiguous(), ab["B"].to(dtype).contiguous()
        if b.shape[0] != end - start:
            raise ValueError(f"{module}'s lora_B has {b.shape[0]} rows, the model's projection {end - start}")
        attach.append((wrapper, (start, start + b.shape[0], a, b, scale)))
    return attach
