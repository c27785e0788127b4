"""Llama decoder layers as one fused forward: one GEMM for q, k and v and one for gate and up (the weights
concatenated once at load), RoPE, SiLU-and-multiply and "add a sublayer's output to the residual stream, then
RMSNorm it" in C++ kernels, and the residual stream optionally kept in float32 under bf16 weights (as llama.cpp
does: bf16 rounding then touches only what enters a GEMM). A layer followed by another fused one leaves its MLP
output for that layer's first norm to add, so the stream is read and written once per sublayer, not twice.

A layer qualifies when its own code, its attention's, its MLP's and its norms' are transformers' Llama code,
bytecode for bytecode (as for the single kernels): SmolLM2 and Llama 3 do; Mistral and Qwen2 pass a sliding window
and keep their modules' forwards.
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers import attention
from pagedllm.backends.cpu.layers.module_swap import INSIDE_FUSED_LAYER, code_of
from pagedllm.backends.cpu.layers.packed_linear import SWIGLU_GATE_UP
from pagedllm.backends.cpu.layers.quant_formats import concatenate
from pagedllm.backends.cpu.layers.quantized_linear import attach, quantized_weight

RESIDUAL_DTYPES = ("float32", "model")


def _llama_code() -> dict:
    from transformers.activations import SiLUActivation
    from transformers.models.llama import modeling_llama as llama

    return {"layer": code_of(llama.LlamaDecoderLayer.forward), "attention": code_of(llama.LlamaAttention.forward),
            "rotate": (code_of(llama.apply_rotary_pos_emb), code_of(llama.rotate_half)),
            "mlp": code_of(llama.LlamaMLP.forward), "norm": code_of(llama.LlamaRMSNorm.forward),
            "silu": (SiLUActivation, torch.nn.SiLU)}


def _qualifies(layer: torch.nn.Module, llama: dict) -> bool:
    if code_of(type(layer).forward) != llama["layer"]:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    used = getattr(type(attn).forward, "__globals__", {})
    return (code_of(type(attn).forward) == llama["attention"]
            and (code_of(used.get("apply_rotary_pos_emb")), code_of(used.get("rotate_half"))) == llama["rotate"]
            and code_of(type(mlp).forward) == llama["mlp"] and isinstance(mlp.act_fn, llama["silu"])
            and all(code_of(type(n).forward) == llama["norm"]
                    for n in (layer.input_layernorm, layer.post_attention_layernorm)))


def _concatenated(*linears: torch.nn.Linear) -> torch.nn.Linear:
    """One nn.Linear whose output is the given layers' outputs side by side (their quantized weights concatenated
    when they carry some)."""
    first = linears[0]
    weights = [quantized_weight(lin) for lin in linears]
    quantized = all(weight is not None for weight in weights)
    fused = torch.nn.Linear(first.in_features, sum(lin.out_features for lin in linears),
                            bias=first.bias is not None, dtype=first.weight.dtype,
                            device="meta" if quantized else None)
    with torch.no_grad():
        if quantized:
            attach(fused, concatenate(weights))
        else:
            fused.weight.copy_(torch.cat([lin.weight if w is None else w.dequantize().to(lin.weight.dtype)
                                          for lin, w in zip(linears, weights)]))
        if first.bias is not None:
            fused.bias = torch.nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused


def use_fused_decoder_layers(model: torch.nn.Module, kernels, residual_dtype: torch.dtype,
                             fuse_silu: bool = True) -> int:
    """Give every qualifying decoder layer the fused forward; returns how many. Call before packing the linears,
    so that the concatenated ones are packed too. ``fuse_silu`` lets gate/up take SiLU-and-multiply in their GEMM's
    epilogue (not with LoRA adapters, which add to gate and up before it)."""
    if kernels is None:
        return 0
    llama = _llama_code()
    layers = [m for m in model.modules() if _qualifies(m, llama)]
    carry = _ResidualCarry()
    deferring = _followed_by_fused(model, layers)
    receiving = set(deferring.values())
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        # Widths from the layers, not the config: a tensor-parallel rank holds a share of the heads and columns.
        widths = (attn.q_proj.out_features, attn.k_proj.out_features, mlp.gate_proj.out_features)
        attn.qkv_proj = _concatenated(attn.q_proj, attn.k_proj, attn.v_proj)
        mlp.gate_up_proj = _concatenated(mlp.gate_proj, mlp.up_proj)
        attn.qkv_proj_widths = (widths[0], widths[1], widths[1])  # the parts' columns, for LoRA adapters
        mlp.gate_up_proj_widths = (widths[2], widths[2])
        if fuse_silu:
            setattr(mlp.gate_up_proj, SWIGLU_GATE_UP, True)
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj  # the weights are held once
        for part in (attn, mlp, layer.input_layernorm, layer.post_attention_layernorm):
            setattr(part, INSIDE_FUSED_LAYER, True)
        layer.forward = _fused_forward(layer, kernels, residual_dtype, *widths, carry=carry,
                                       receives=id(layer) in receiving, defers=id(layer) in deferring)
    return len(layers)


class _ResidualCarry:
    """An MLP output not yet added to the residual stream, handed from one fused layer to the next."""

    def __init__(self) -> None:
        self.stream: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    def take(self, stream: torch.Tensor) -> torch.Tensor:
        pending, owner = self.pending, self.stream
        self.stream = self.pending = None
        if pending is None or owner is not stream:
            raise RuntimeError("a fused decoder layer's output was not passed straight to the next layer")
        return pending


def _followed_by_fused(model: torch.nn.Module, layers: list[torch.nn.Module]) -> dict[int, int]:
    """id(layer) -> id(next layer) for each fused layer that the model's layer list runs right before another."""
    fused = set(map(id, layers))
    pairs = {}
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            items = list(module)
            pairs.update({id(a): id(b) for a, b in zip(items, items[1:]) if id(a) in fused and id(b) in fused})
    return pairs


def _fused_forward(layer: torch.nn.Module, kernels, residual_dtype: torch.dtype, q_width: int, kv_width: int,
                   intermediate: int, carry: _ResidualCarry, receives: bool, defers: bool):
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
    input_eps, post_eps = float(input_norm.variance_epsilon), float(post_norm.variance_epsilon)
    layer_idx = attn.layer_idx

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids=None,
                past_key_values=None, use_cache: bool | None = False,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        # The residual stream: the embeddings in the first layer (copied when the stream is float32), updated in
        # place after that.
        stream = hidden_states if hidden_states.dtype == residual_dtype else hidden_states.to(residual_dtype)
        tokens = stream.shape[:-1]
        if receives:
            x = kernels.add_rms_norm(carry.take(stream), stream, input_norm.weight, input_eps)
        else:
            x = kernels.rms_norm(stream, input_norm.weight, input_eps)
        # The projections are looked up per call (they are swapped for packed ones after this). Their forward and the
        # token-major attention are called straight: module calls' hook checks and transformers' head-major views
        # are Python work a small decode step pays in every layer.
        q, k, v = attn.qkv_proj.forward(x).split([q_width, kv_width, kv_width], dim=-1)
        cos, sin = position_embeddings
        kernels.rotary_embedding(q, k, cos.contiguous(), sin.contiguous(), head_dim)
        heads = (stream.shape[-2], -1, head_dim)
        out = attention.attend(layer_idx, q.view(heads), k.view(heads), v.view(heads), attn.scaling,
                               kwargs.get("sliding_window"), kwargs["paged_metadata"])
        h = attn.o_proj.forward(out.view(*tokens, -1))
        x = kernels.add_rms_norm(h, stream, post_norm.weight, post_eps)
        gate_up = mlp.gate_up_proj
        if getattr(gate_up, "fuses_silu_and_mul", False):
            h = mlp.down_proj.forward(gate_up.forward(x))
        else:
            both = gate_up.forward(x)
            h = mlp.down_proj.forward(kernels.silu_and_mul(both[..., :intermediate], both[..., intermediate:]))
        if defers:
            carry.stream, carry.pending = stream, h
            return stream
        return stream.add_(h)

    return forward
