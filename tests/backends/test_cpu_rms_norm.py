"""The fused RMSNorm takes over Llama-family norm layers only, and computes what they compute."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from pagedllm.backends.cpu.layers.rms_norm import use_fused_rms_norms
from pagedllm.backends.cpu.runner.kernels import load_kernels

kernels, _ = load_kernels("auto")
pytestmark = [pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("shape", [(1, 7, 576), (1, 3, 9, 64), (1, 1, 5)])
def test_fused_norm_matches_the_module(cls, dtype, tol, shape):
    torch.manual_seed(0)
    norm = cls(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(shape) * 3).to(dtype)
    expected = norm(x)
    use_fused_rms_norms(norm, kernels)
    assert "forward" in norm.__dict__
    torch.testing.assert_close(norm(x), expected, atol=tol, rtol=tol)
    transposed = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # not contiguous: the module's own forward
    torch.testing.assert_close(norm(transposed), expected, atol=tol, rtol=tol)


def test_gemma_norm_keeps_its_own_forward():
    norm = GemmaRMSNorm(16)
    use_fused_rms_norms(norm, kernels)
    assert "forward" not in norm.__dict__


@pytest.mark.parametrize("dim", [576, 5])
def test_a_float32_stream_is_normed_into_the_weights_dtype(dim):
    torch.manual_seed(0)
    weight = torch.randn(dim).bfloat16()
    x = torch.randn(3, dim) * 3
    expected = (weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))).bfloat16()
    got = kernels.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("stream_dtype, dtype, tol", [(torch.float32, torch.float32, 1e-6),
                                                      (torch.bfloat16, torch.bfloat16, 1e-2),
                                                      (torch.float32, torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dim", [576, 24, 5])
def test_add_rms_norm_adds_in_place_then_norms(stream_dtype, dtype, tol, dim):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    residual, h = (torch.randn(4, dim) * 3).to(stream_dtype), torch.randn(4, dim).to(dtype)
    expected_stream = (residual.float() + h.float()).to(stream_dtype)  # torch's add in the stream's dtype
    expected = norm(expected_stream.to(dtype)) if stream_dtype == dtype else \
        (norm.weight.float()
         * (expected_stream * torch.rsqrt(expected_stream.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dtype)
    got = kernels.add_rms_norm(h, residual, norm.weight, 1e-5)
    assert torch.equal(residual, expected_stream) and got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
