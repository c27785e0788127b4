"""Packed linear layers (oneDNN's, and the kernels' brgemm tiles for bf16) give nn.Linear's results to the dtype's
rounding and replace the plain weights."""

import pytest
import torch

from pagedllm.backends.cpu.layers.packed_linear import (
    MAX_BRGEMM_IN_FEATURES,
    SWIGLU_GATE_UP,
    BrgemmLinear,
    BrgemmSiluAndMul,
    PackedLinear,
    can_pack,
    float32_logits,
    use_packed_linears,
)
from pagedllm.backends.cpu.runner.kernels import load_kernels

kernels, _ = load_kernels("auto")
has_brgemm = kernels is not None and kernels.linear_bf16_available()

pytestmark = [pytest.mark.skipif(not can_pack(), reason="this torch has no oneDNN weight packing"), pytest.mark.cpu_isa]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 300])
def test_packed_linear_matches_nn_linear(bias, rows):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 40, bias=bias), torch.nn.GELU(), torch.nn.Linear(40, 24, bias=bias))
    x = torch.randn(1, rows, 96)
    expected = model(x)
    assert use_packed_linears(model) == {"quantized": 0, "brgemm": 0, "brgemm+silu": 0, "oneDNN": 2}
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
    assert use_packed_linears(model) == {"quantized": 0, "brgemm": 0, "brgemm+silu": 0, "oneDNN": 1}
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
    assert use_packed_linears(model)["oneDNN"] == 1 and isinstance(model[0], PackedLinear)
    torch.testing.assert_close(model(x), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(can_pack(torch.bfloat16), reason="this CPU packs bf16 weights")
def test_bf16_layers_keep_nn_linear_without_avx512():
    model = torch.nn.Sequential(torch.nn.Linear(8, 4).to(torch.bfloat16))
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 0, "brgemm+silu": 0, "oneDNN": 0}
    assert type(model[0]) is torch.nn.Linear


brgemm_only = pytest.mark.skipif(not has_brgemm, reason="the bf16 brgemm linear needs kernels built for AVX512_BF16")


@brgemm_only
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 65, 300])
@pytest.mark.parametrize("in_features, out_features", [(96, 40), (64, 100), (18, 130), (2, 3), (160, 576)])
def test_brgemm_linear_matches_nn_linear_in_bf16(bias, rows, in_features, out_features):
    """Widths that are not a multiple of the 64-column blocks, row counts across the 64-row tiles, two leading
    dimensions: nn.Linear's bf16 output, rounded from the same float32 sums (up to their order)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16))
    x = torch.randn(2, rows, in_features).to(torch.bfloat16)
    expected = model(x)
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 1, "brgemm+silu": 0, "oneDNN": 0}
    assert isinstance(model[0], BrgemmLinear)
    assert model[0].weight.shape != (out_features, in_features)  # the plain weight is gone
    got = model(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


@brgemm_only
def test_brgemm_linear_takes_strided_rows():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 72).to(torch.bfloat16))
    wide = torch.randn(10, 130).to(torch.bfloat16)
    inputs = [wide[:, 3:67], wide[:, ::2][:, :64], wide[:, :128].reshape(10, 2, 64).transpose(0, 1)]
    expected = [model(x) for x in inputs]
    use_packed_linears(model, kernels)
    for x, want in zip(inputs, expected):
        torch.testing.assert_close(model(x), want, atol=1e-2, rtol=1e-2)


@brgemm_only
def test_inputs_wider_than_brgemms_limit_stay_with_onednn():
    """A down projection of a 1B-class model (thousands wide) runs faster through oneDNN's input blocking."""
    model = torch.nn.Sequential(torch.nn.Linear(MAX_BRGEMM_IN_FEATURES, 8).to(torch.bfloat16),
                                torch.nn.Linear(MAX_BRGEMM_IN_FEATURES + 2, 8).to(torch.bfloat16))
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 1, "brgemm+silu": 0, "oneDNN": 1}
    assert isinstance(model[0], BrgemmLinear) and isinstance(model[1], PackedLinear)


@brgemm_only
def test_odd_input_widths_and_float32_stay_with_onednn():
    """brgemm takes pairs of bf16 along the input; float32 layers keep oneDNN's packing."""
    model = torch.nn.Sequential(torch.nn.Linear(9, 16).to(torch.bfloat16), torch.nn.Linear(16, 8))
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 0, "brgemm+silu": 0, "oneDNN": 2}
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], PackedLinear)


@brgemm_only
def test_a_tied_bf16_head_keeps_the_embedding_weight():
    embed = torch.nn.Embedding(50, 16).to(torch.bfloat16)
    head = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    ids = torch.tensor([[3, 7, 11]])
    expected = model["head"](model["embed"](ids))
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 1, "brgemm+silu": 0, "oneDNN": 0}
    torch.testing.assert_close(model["head"](model["embed"](ids)), expected, atol=1e-2, rtol=1e-2)
    assert model["embed"].weight.shape == (50, 16)


@brgemm_only
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 65, 300])
@pytest.mark.parametrize("in_features, width", [(576, 1536), (64, 96), (18, 37)])
def test_gate_up_with_silu_and_mul_fused_equals_the_two_steps_bit_for_bit(bias, rows, in_features, width):
    """A SwiGLU's marked gate/up projection returns silu(gate) * up from one call: exactly what its brgemm output
    followed by the silu_and_mul kernel gives (widths past whole 64-column blocks too)."""
    torch.manual_seed(0)
    gate_up = torch.nn.Linear(in_features, 2 * width, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, in_features).to(torch.bfloat16)
    both = BrgemmLinear(gate_up, kernels)(x)
    expected = kernels.silu_and_mul(both[..., :width], both[..., width:])
    setattr(gate_up, SWIGLU_GATE_UP, True)
    model = torch.nn.Sequential(gate_up)
    assert use_packed_linears(model, kernels) == {"quantized": 0, "brgemm": 0, "brgemm+silu": 1, "oneDNN": 0}
    assert isinstance(model[0], BrgemmSiluAndMul) and model[0].fuses_silu_and_mul
    got = model[0](x)
    assert got.shape == (2, rows, width)
    assert torch.equal(got, expected)


def test_a_marked_gate_up_without_brgemm_keeps_its_concatenated_output():
    """Only the brgemm form fuses; oneDNN's packing (or no packing) returns gate and up side by side."""
    gate_up = torch.nn.Linear(16, 2 * 24)
    setattr(gate_up, SWIGLU_GATE_UP, True)
    model = torch.nn.Sequential(gate_up)
    use_packed_linears(model, kernels)
    assert not getattr(model[0], "fuses_silu_and_mul", False)
    assert model[0](torch.randn(3, 16)).shape == (3, 48)


class _HeadModel(torch.nn.Module):
    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


@brgemm_only
@pytest.mark.parametrize("bias", [True, False])
def test_a_brgemm_lm_head_returns_float32_logits_that_round_to_its_bf16_ones(bias):
    """The float32 sums the bf16 output is rounded from: what the sampler reads, without the copy or the ties."""
    torch.manual_seed(0)
    model = _HeadModel(torch.nn.Linear(64, 300, bias=bias).to(torch.bfloat16))
    x = torch.randn(5, 64).to(torch.bfloat16)
    exact = x.float() @ model.head.weight.float().T + (model.head.bias.float() if bias else 0)
    use_packed_linears(model, kernels)
    rounded = model.head(x)
    assert float32_logits(model) and model.head.float_output
    logits = model.head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 300)
    torch.testing.assert_close(logits, exact, atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.to(torch.bfloat16), rounded)


@brgemm_only
def test_a_head_wider_than_brgemms_limit_still_returns_float32_logits():
    """The LM head of a model wider than the brgemm linears' limit (an 8B's 4096) goes through brgemm all the same:
    oneDNN would round its logits to bf16."""
    model = _HeadModel(torch.nn.Linear(MAX_BRGEMM_IN_FEATURES + 64, 40, bias=False).to(torch.bfloat16))
    use_packed_linears(model, kernels)
    assert isinstance(model.head, BrgemmLinear) and float32_logits(model)
    assert model.head(torch.randn(3, MAX_BRGEMM_IN_FEATURES + 64).to(torch.bfloat16)).dtype == torch.float32


def test_a_head_without_brgemm_keeps_its_output_dtype():
    model = _HeadModel(torch.nn.Linear(16, 24))
    use_packed_linears(model, kernels)
    assert not float32_logits(model)
    assert model.head(torch.randn(2, 16)).dtype == torch.float32
