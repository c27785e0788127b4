"""The fused RoPE takes over Llama-family attention layers only, and computes bit for bit what they compute."""

import pytest
import torch
from transformers import GemmaConfig, GlmConfig, GraniteConfig, LlamaConfig, Qwen2Config
from transformers.models.gemma.modeling_gemma import GemmaAttention, GemmaRotaryEmbedding
from transformers.models.glm.modeling_glm import GlmAttention, GlmRotaryEmbedding
from transformers.models.granite.modeling_granite import GraniteAttention, GraniteRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
from pagedllm.backends.cpu.layers.rotary import use_fused_rotary
from pagedllm.backends.cpu.runner.kernels import load_kernels

kernels, _ = load_kernels("auto")
pytestmark = [pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]


def _config(cls, head_dim=16, heads=4, kv_heads=2, **extra):
    return cls(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
               intermediate_size=96, attn_implementation="eager", **extra)


@pytest.mark.parametrize("head_dim, heads, kv_heads, tokens", [(64, 9, 3, 7), (128, 4, 2, 33), (32, 2, 2, 1),
                                                             (16, 4, 1, 0)])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_kernel_is_bit_for_bit_transformers(head_dim, heads, kv_heads, tokens, scaling):
    torch.manual_seed(0)
    config = _config(LlamaConfig, head_dim, heads, kv_heads, rope_parameters=scaling and {"rope_theta": 500000.0,
                                                                                           **scaling})
    query, key = torch.randn(1, tokens, heads * head_dim) * 3, torch.randn(1, tokens, kv_heads * head_dim) * 3
    cos, sin = LlamaRotaryEmbedding(config)(query, torch.arange(1000, 1000 + tokens)[None])
    heads_first = lambda x: x.view(1, tokens, x.shape[-1] // head_dim, head_dim).transpose(1, 2)
    expected_q, expected_k = apply_rotary_pos_emb(heads_first(query), heads_first(key), cos, sin)
    kernels.rotary_embedding(query, key, cos, sin, head_dim)
    assert torch.equal(heads_first(query), expected_q) and torch.equal(heads_first(key), expected_k)


@pytest.mark.parametrize("trig", [torch.bfloat16, torch.float32])
def test_bf16_rotation_is_float32_math_rounded_once(trig):
    torch.manual_seed(0)
    tokens, head_dim = 5, 64
    query, key = torch.randn(1, tokens, 3 * head_dim).bfloat16(), torch.randn(1, tokens, head_dim).bfloat16()
    angles = torch.randn(1, tokens, head_dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(trig), torch.cat([angles.sin()] * 2, -1).to(trig)
    heads_first = lambda x: x.view(1, tokens, x.shape[-1] // head_dim, head_dim).transpose(1, 2)
    expected_q, expected_k = apply_rotary_pos_emb(heads_first(query).float(), heads_first(key).float(), cos.float(),
                                                  sin.float())
    kernels.rotary_embedding(query, key, cos, sin, head_dim)
    torch.testing.assert_close(heads_first(query), expected_q.bfloat16(), atol=0, rtol=1 / 128)
    torch.testing.assert_close(heads_first(key), expected_k.bfloat16(), atol=0, rtol=1 / 128)


def test_kernel_refuses_what_it_cannot_rotate():
    q, k, cos = torch.randn(1, 3, 32), torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    with pytest.raises(RuntimeError, match="query and key dtypes differ"):
        kernels.rotary_embedding(q.bfloat16(), k, cos, cos, 16)
    with pytest.raises(RuntimeError, match="float32 query needs float32 cos"):
        kernels.rotary_embedding(q, k, cos.bfloat16(), cos.bfloat16(), 16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rotary_embedding(q.half(), k.half(), cos, cos, 16)
    with pytest.raises(RuntimeError, match="head_size"):
        kernels.rotary_embedding(q, k, cos[..., :8].contiguous(), cos[..., :8].contiguous(), 16)
    with pytest.raises(RuntimeError, match="same tokens"):
        kernels.rotary_embedding(q, k[:, :2], cos, cos, 16)


def _layer(attention_cls, rotary_cls, config_cls, **extra):
    torch.manual_seed(0)
    config = _config(config_cls, **extra)
    return attention_cls(config, layer_idx=0).eval(), rotary_cls(config)


@pytest.mark.parametrize("make", [lambda: _layer(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig),
                                  lambda: _layer(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig,
                                                 attention_bias=True),
                                  lambda: _layer(GemmaAttention, GemmaRotaryEmbedding, GemmaConfig),
                                  lambda: _layer(GraniteAttention, GraniteRotaryEmbedding, GraniteConfig)])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_layer_matches_the_module(make, packed):
    attn, rotary = make()
    x = torch.randn(1, 5, 64)
    position_embeddings = rotary(x, torch.arange(3, 8)[None])
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings, None)
        assert use_fused_rotary(attn, kernels) == 1 and "forward" in attn.__dict__
        if packed:  # packed after fusing, as the model runner does: oneDNN sums in another order
            use_packed_linears(attn)
            torch.testing.assert_close(attn(x, position_embeddings, None)[0], expected, atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(attn(x, position_embeddings, None)[0], expected)


def test_cos_broadcast_over_a_batch_takes_the_module_forward():
    attn, rotary = _layer(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig)
    x = torch.randn(2, 5, 64)
    position_embeddings = rotary(x, torch.arange(5)[None])  # [1, 5, head_dim], broadcast over the batch of 2
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings, None)
        use_fused_rotary(attn, kernels)
        assert torch.equal(attn(x, position_embeddings, None)[0], expected)


def test_bfloat16_layer_rotates_in_float32_rounded_once():
    attn, rotary = _layer(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig)
    attn.to(torch.bfloat16)
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    position_embeddings = rotary(x, torch.arange(5)[None])
    with torch.no_grad():
        expected, _ = attn(x, position_embeddings, None)  # torch rounds after each op
        assert use_fused_rotary(attn, kernels) == 1
        torch.testing.assert_close(attn(x, position_embeddings, None)[0], expected, atol=2e-2, rtol=2e-2)


def test_other_attention_layers_keep_their_forward():
    glm, _ = _layer(GlmAttention, GlmRotaryEmbedding, GlmConfig)  # Llama's forward, interleaved rotation
    qwen2, _ = _layer(Qwen2Attention, Qwen2RotaryEmbedding, Qwen2Config)
    assert use_fused_rotary(torch.nn.ModuleList([glm, qwen2]), kernels) == 0
    assert all("forward" not in m.__dict__ for m in (glm, qwen2))
