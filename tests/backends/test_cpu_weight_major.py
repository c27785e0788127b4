"""Small-batch linear layers as weight @ x.T give nn.Linear's results (to fp32 rounding) in its layout."""

import pytest
import torch

from pagedllm.backends.cpu.kernels import load_kernels
from pagedllm.backends.cpu.weight_major import MAX_ROWS, use_weight_major_linears


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64, MAX_ROWS, MAX_ROWS + 1, 300])
def test_weight_major_linear_matches_nn_linear(use_kernels, bias, rows):
    kernels = load_kernels("auto")[0] if use_kernels else None
    if use_kernels and kernels is None:
        pytest.skip("the C++ kernels could not be built here")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=bias), torch.nn.Linear(40, 24, bias=bias))
    x = torch.randn(1, rows, 96)
    expected = model(x)
    use_weight_major_linears(model, kernels)
    assert all("forward" in layer.__dict__ for layer in model)  # both layers took the path
    got = model(x)
    assert got.shape == expected.shape and got.is_contiguous()
    if rows > MAX_ROWS:
        assert torch.equal(got, expected)  # large inputs keep nn.Linear
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_bf16_layers_keep_nn_linear():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    use_weight_major_linears(layer)
    assert "forward" not in layer.__dict__
