"""The fused SwiGLU takes over Llama-family MLPs only, and computes what they compute."""

import pytest
import torch
import torch.nn.functional as F
from transformers import GemmaConfig, LlamaConfig, Qwen2Config
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
from pagedllm.backends.cpu.layers.swiglu import use_fused_swiglu
from pagedllm.backends.cpu.runner.kernels import load_kernels

kernels, _ = load_kernels("auto")
pytestmark = [pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(3, 2 * 1536), (2, 2 * 29), (1, 2, 2 * 13), (0, 8)])  # 29: 16 + 8 + 5 lanes
@pytest.mark.parametrize("separate", [False, True])
def test_silu_and_mul_matches_torch(dtype, tol, shape, separate):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 6).to(dtype)
    if x.numel():
        x.view(-1)[:4] = torch.tensor([100.0, -100.0, 0.0, -0.0], dtype=dtype)  # no overflow, no NaN at the ends
    width = shape[-1] // 2
    expected = (F.silu(x[..., :width].float()) * x[..., width:].float()).to(dtype)
    gate, up = x[..., :width], x[..., width:]  # rows strided, as halves of one projection's output
    if separate:
        gate, up = gate.contiguous(), up.contiguous()
    got = kernels.silu_and_mul(gate, up)
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # a scale per row on both first (W8A8's activation scales)
    rows = gate.reshape(-1, width).shape[0]
    scales = torch.rand(rows, 1) * 2
    g, u = gate.reshape(-1, width).float() * scales, up.reshape(-1, width).float() * scales
    scaled = (F.silu(g) * u).to(dtype).reshape(expected.shape)
    torch.testing.assert_close(kernels.silu_and_mul(gate, up, scales), scaled, atol=tol, rtol=tol)


def _mlp(cls, config_cls, hidden_act="silu", **extra):
    torch.manual_seed(0)
    return cls(config_cls(hidden_size=64, intermediate_size=96, hidden_act=hidden_act, **extra)).eval()


@pytest.mark.parametrize("make", [lambda: _mlp(LlamaMLP, LlamaConfig),
                                  lambda: _mlp(LlamaMLP, LlamaConfig, mlp_bias=True),
                                  lambda: _mlp(Qwen2MLP, Qwen2Config)])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_mlp_matches_the_module(make, packed):
    mlp = make()
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        expected = mlp(x)
        assert use_fused_swiglu(mlp, kernels) == 1
        assert "forward" in mlp.__dict__
        if packed:
            use_packed_linears(mlp)
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


def test_other_mlps_keep_their_forward():
    gemma = _mlp(GemmaMLP, GemmaConfig, hidden_act="gelu_pytorch_tanh")
    llama_gelu = _mlp(LlamaMLP, LlamaConfig)
    llama_gelu.act_fn = torch.nn.GELU()
    assert use_fused_swiglu(torch.nn.ModuleList([gemma, llama_gelu]), kernels) == 0
    assert all("forward" not in m.__dict__ for m in (gemma, llama_gelu))


def test_bf16_mlp_is_fused_too():
    mlp = _mlp(LlamaMLP, LlamaConfig).to(torch.bfloat16)
    x = torch.randn(1, 7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = mlp(x)  # torch rounds silu's output before the multiply; the kernel rounds once
        assert use_fused_swiglu(mlp, kernels) == 1
        torch.testing.assert_close(mlp(x), expected, atol=2e-2, rtol=2e-2)
