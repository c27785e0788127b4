"""LoRA adapters on the decoder layers' projections, several in one batch (as punica and vLLM's LoRA layers do):
each projection runs its base GEMM once over every row, then adds ``scale * (x @ A^T) @ B^T`` of each row's own
adapter. Each layer keeps its adapters' A and B stacked by slot (the parts of a fused q/k/v or gate/up side by side,
each B in its own columns). A step groups the rows by adapter once; every layer then adds all adapters' products in
one call of the C++ kernel (csrc/lora.cpp: tiles of one adapter's rows, float32 sums, each fused part's own columns
only), or, without the kernels, gathers each adapter's rows into a padded grid and runs two batched GEMMs (bmm):
no Python loop over adapters either way, no adapter's product on another's rows. Adapters are in peft's format and
target any of q, k, v, o, gate, up and down; where those are fused into one GEMM (q/k/v, gate/up) each adds to its
slice of the output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pagedllm.errors import ConfigError

FLOAT32_ROWS = 512  # steps with up to this many adapter rows compute the low-rank products in float32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class StepAdapters:
    """What every LoRA layer of a model needs of the current step, made once per step: the rows of each adapter in
    it (for the kernel, grouped by adapter; for the torch path, gathered into a padded [adapters, rows] grid), and
    each adapter's slot in the layers' stacked weights."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}  # lora id -> its slot in every layer's stacks (the runner assigns them)
        self.kernels = None  # the C++ kernels' module (csrc/lora.cpp), if built: lora_add instead of torch ops
        self.active = False
        self.slot_index = self.gather = self.valid = self.rows = self.groups = None
        self.shape = (0, 0)

    def set(self, lora_ids, query_start_loc) -> None:
        """From a batch's ``lora_ids`` (per sequence, 0 for none) and ``query_start_loc``: numpy, no Python loop
        over the step's tokens."""
        self.active = False
        if lora_ids is None:
            return
        row_lora = np.repeat(lora_ids, np.diff(query_start_loc))
        groups = [(lora_id, np.flatnonzero(row_lora == lora_id)) for lora_id in np.unique(row_lora)
                  if lora_id and int(lora_id) in self.slots]
        if not groups:
            return
        longest = max(len(rows) for _, rows in groups)
        grid = np.stack([np.pad(rows, (0, longest - len(rows)), mode="edge") for _, rows in groups])  # padding
        valid = np.arange(longest)[None, :] < np.array([len(rows) for _, rows in groups])[:, None]   # dropped after
        slots = [self.slots[int(lora_id)] for lora_id, _ in groups]
        self.shape = (len(groups), longest)
        self.slot_index = None if slots == list(range(len(self.slots))) else torch.tensor(slots)  # None: all, in order
        self.gather = torch.from_numpy(grid.reshape(-1))
        self.valid = torch.from_numpy(np.flatnonzero(valid))
        self.rows = torch.from_numpy(np.concatenate([rows for _, rows in groups]).astype(np.int64))
        counts = np.array([len(rows) for _, rows in groups], dtype=np.int64)
        self.groups = torch.from_numpy(np.stack([np.cumsum(counts) - counts, counts, np.array(slots)], axis=1))
        self.padded = len(self.valid) != len(self.gather)
        self.active = True


class LoRALinear(torch.nn.Module):
    """A projection (or a fused one) and the adapters' low-rank products on the rows that asked for them.
    ``slices`` maps each projection it computes to its columns of the output."""

    def __init__(self, base: torch.nn.Module, slices: dict[str, tuple[int, int]], step: StepAdapters) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.in_features = base.in_features
        self.out_features = max(end for _, end in slices.values())
        # lora id -> [(first column, end column, A [rank, in], B [columns, rank], scale)]
        self.adapters: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
        # per dtype: [slots, in, rank], every adapter's A of every part side by side; [slots, rank, out], each part's
        # B in its columns, times its scale
        self._stacks: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._parts = torch.zeros(0, len(slices), 4, dtype=torch.int64)  # per slot: each part's columns and ranks

    def set_adapter(self, lora_id: int, parts: list | None, dtype: torch.dtype) -> None:
        """Attach an adapter's parts (None: remove it); the stacks are made again from the slots in use."""
        if parts is None:
            self.adapters.pop(lora_id, None)
        else:
            self.adapters[lora_id] = parts
        self._stacks = {}
        if not any(self.adapters.values()) or not self.step.slots:
            return
        slots = max(self.step.slots.values()) + 1
        rank = max(sum(a.shape[0] for _, _, a, _, _ in ps) for ps in self.adapters.values())
        a_stack = torch.zeros(slots, self.in_features, rank, dtype=torch.float32)
        b_stack = torch.zeros(slots, rank, self.out_features, dtype=torch.float32)
        self._parts = torch.zeros(slots, self._parts.shape[1], 4, dtype=torch.int64)
        for adapter_id, adapter_parts in self.adapters.items():
            slot, column = self.step.slots[adapter_id], 0
            for index, (start, end, a, b, scale) in enumerate(adapter_parts):
                a_stack[slot, :, column:column + a.shape[0]] = a.t()
                b_stack[slot, column:column + a.shape[0], start:end] = b.t() * scale
                self._parts[slot, index] = torch.tensor([start, end, column, column + a.shape[0]])
                column += a.shape[0]
        # The kernel of a bf16 model reads them in bf16, half the bytes (it sums in float32 either way), and keeps
        # only those. Otherwise float32: a float32 model's kernel, and the torch path's steps of few rows (torch's
        # small bf16 GEMMs are slow on CPUs); the torch path makes the model's dtype when first needed (large steps).
        keep = torch.bfloat16 if dtype == torch.bfloat16 and self.step.kernels is not None else torch.float32
        self._stacks = {keep: (a_stack.to(keep), b_stack.to(keep))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.forward(x)
        step = self.step
        if not step.active or not self._stacks:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if step.kernels is not None and flat_x.dtype == flat_out.dtype:
            a, b = next(iter(self._stacks.values()))  # the kernel takes either dtype with either rows
            step.kernels.lora_add(flat_out, flat_x.contiguous(), a, b, self._parts, step.rows, step.groups)
            return out
        groups, longest = step.shape
        dtype = torch.float32 if groups * longest <= FLOAT32_ROWS else x.dtype
        if dtype not in self._stacks:
            self._stacks[dtype] = tuple(t.to(dtype) for t in next(iter(self._stacks.values())))
        a, b = self._stacks[dtype]
        if step.slot_index is not None:
            a, b = a.index_select(0, step.slot_index), b.index_select(0, step.slot_index)
        xs = flat_x.index_select(0, step.gather).view(groups, longest, -1).to(dtype)
        delta = torch.bmm(torch.bmm(xs, a), b).view(groups * longest, -1)
        if step.padded:
            delta = delta.index_select(0, step.valid)
        flat_out.index_add_(0, step.rows, delta.to(out.dtype))
        return out


def wrap_projections(model: torch.nn.Module, step: StepAdapters) -> dict[str, tuple[LoRALinear, int, int]]:
    """Wrap each decoder layer's projections (nn.Linear still: they are packed inside the wrappers afterwards);
    returns, for each projection as peft names it
    (``model.layers.3.self_attn.q_proj``), its wrapper and columns."""
    targets: dict[str, tuple[LoRALinear, int, int]] = {}
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") and not (
            hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "qkv_proj_widths"))
            for layer in layers):
        raise ConfigError(f"--enable-lora: adapters run on Llama-family decoder layers (self_attn with q/k/v/o and an "
                          f"mlp with gate/up/down); this model is {model.config.model_type!r}")
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
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported")
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
        if b.shape[0] != end - start or a.shape[1] != wrapper.in_features or a.shape[0] != b.shape[1]:
            raise ValueError(f"{module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                             f"projection ({wrapper.in_features} inputs, {end - start} outputs)")
        attach.append((wrapper, (start, start + b.shape[0], a, b, scale)))
    return attach
