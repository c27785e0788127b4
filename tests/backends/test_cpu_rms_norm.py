"""The fused RMSNorm takes over Llama-family norm layers only, and computes what they compute."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from pagedllm.backends.cpu.kernels import load_kernels
from pagedllm.backends.cpu.rms_norm import use_fused_rms_norms

kernels, _ = load_kernels("auto")
pytestmark = [pytest.mark.skipif(kernels is None, reason="the C++ kernels could not be built here"), pytest.mark.cpu_isa]


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
