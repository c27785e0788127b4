"""oneDNN-packed linear layers give nn.Linear's results (to fp32 rounding) and replace the plain weights."""

import pytest
import torch

from pagedllm.backends.cpu.packed_linear import PackedLinear, can_pack, use_packed_linears

pytestmark = [pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN weight packing"), pytest.mark.cpu_isa]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 300])
def test_packed_linear_matches_nn_linear(bias, rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=bias), torch.nn.GELU(), torch.nn.Linear(40, 24, bias=bias))
    x = torch.randn(1, rows, 96)
    expected = model(x)
    assert use_packed_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2], PackedLinear)
    assert model[0].weight.is_mkldnn  # the plain weight is gone, not kept beside the packed one
    got = model(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_tied_head_keeps_the_embedding_weight():
    embed = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    ids = torch.tensor([[3, 7, 11]])
    expected = model["head"](model["embed"](ids))
    assert use_packed_linears(model) == 1
    assert isinstance(model["head"], PackedLinear)
    torch.testing.assert_close(model["head"](model["embed"](ids)), expected, atol=1e-5, rtol=1e-5)
    assert not model["embed"].weight.is_mkldnn


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="bf16 packing needs AVX-512 (avx512f/bw/vl/dq)")
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_bf16_layers_are_packed_where_the_cpu_has_avx512(rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40).to(torch.bfloat16))
    x = torch.randn(rows, 96).to(torch.bfloat16)
    expected = model(x)
    assert use_packed_linears(model) == 1 and isinstance(model[0], PackedLinear)
    torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(can_pack(torch.bfloat16), reason="this CPU packs bf16 weights")
def test_bf16_layers_keep_nn_linear_without_avx512():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4).to(torch.bfloat16))
    assert use_packed_linears(model) == 0
    assert type(model[0]) is torch.nn.Linear
