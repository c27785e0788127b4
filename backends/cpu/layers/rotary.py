"""Llama-family attention layers with RoPE applied by one C++ call, in place on the q and k projections.

transformers rotates the query and the key with six torch ops each (multiplies, a negate, a concat, an add).
A module qualifies when its forward is Llama's attention forward, bytecode for bytecode (Gemma, Granite and Arcee
copy it), and the ``apply_rotary_pos_emb`` and ``rotate_half`` its module uses are Llama's too (GLM copies the
forward but rotates interleaved pairs, so it keeps its own). In float32 the kernel does the same arithmetic in the
same order: bit for bit transformers' result; bf16 is computed in float32 and rounded once. Anything else (a KV
cache object, partial rotary) takes the module's own forward.
"""

from __future__ import annotations

import torch

from pagedllm.backends.cpu.layers.module_swap import code_of, swap_forwards


def use_fused_rotary(model: torch.nn.Module, kernels) -> int:
    """Give every qualifying attention layer of the model the fused RoPE; returns how many."""
    if kernels is None:
        return 0
    from transformers.models.llama import modeling_llama as llama

    reference = (code_of(llama.LlamaAttention.forward), code_of(llama.apply_rotary_pos_emb),
                 code_of(llama.rotate_half))

    def names(module: torch.nn.Module) -> dict:  # the globals its forward runs with
        return getattr(type(module).forward, "__globals__", {})

    def qualifies(module: torch.nn.Module) -> bool:
        used = names(module)
        return (code_of(type(module).forward), code_of(used.get("apply_rotary_pos_emb")),
                code_of(used.get("rotate_half"))) == reference

    return swap_forwards(model, qualifies, lambda module: _fused_forward(module, kernels, names(module)))


def _fused_forward(attn: torch.nn.Module, kernels, names: dict):
    unfused = attn.forward
    attention_functions, eager = names["ALL_ATTENTION_FUNCTIONS"], names["eager_attention_forward"]

    def forward(hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, **kwargs):
        cos, sin = position_embeddings
        input_shape = hidden_states.shape[:-1]
        if (past_key_values is not None or hidden_states.dtype not in (torch.float32, torch.bfloat16)
                or (hidden_states.dtype == torch.float32 and cos.dtype != torch.float32)
                or cos.shape != (*input_shape, attn.head_dim) or attn.training):  # e.g. cos broadcast over a batch
            return unfused(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        hidden_shape = (*input_shape, -1, attn.head_dim)
        # The projections are looked up per call: they may be swapped for packed ones after this.
        query, key = attn.q_proj(hidden_states), attn.k_proj(hidden_states)
        value = attn.v_proj(hidden_states)
        kernels.rotary_embedding(query, key, cos.contiguous(), sin.contiguous(), attn.head_dim)
        interface = attention_functions.get_interface(attn.config._attn_implementation, eager)
        out, weights = interface(attn, query.view(hidden_shape).transpose(1, 2), key.view(hidden_shape).transpose(1, 2),
                                 value.view(hidden_shape).transpose(1, 2), attention_mask, dropout=0.0,
                                 scaling=attn.scaling, **kwargs)
        return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward
