"""csrc/lora.cpp's lora_add, as the LoRA layers call it, against each row's low-rank product written out in float64:
adapters of different ranks, one that leaves a fused part out, rows of the base model between them, groups that end
mid-tile, ranks that are and are not a multiple of the vector width, float32 rows and bf16 ones (with A and B in
bf16, as a bf16 model keeps them); on this CPU's build, the generic one and AVX-512's (AVX2's in CI's second pass, as
the AVX2 kind of CPU)."""

import numpy as np
import pytest
import torch

from pagedllm.backends.common.cpu_features import kernel_level, rank
from pagedllm.backends.cpu.layers.lora import LoRALinear, StepAdapters
from pagedllm.backends.cpu.runner.kernels import load_kernels

pytestmark = [pytest.mark.skipif(load_kernels("auto")[0] is None, reason="the C++ kernels could not be built here"),
              pytest.mark.cpu_isa]
LEVELS = sorted({kernel_level(), *(lvl for lvl in ("generic", "avx512") if rank(lvl) <= rank(kernel_level()))},
                key=rank)
# lora id -> rank; adapter 2 leaves the first part out
RANK_SETS = {"wide": {1: 16, 2: 8, 3: 5}, "narrow": {1: 5, 2: 3, 3: 1}}


@pytest.fixture(params=LEVELS, scope="module")
def kernels(request):
    return load_kernels("kernel", request.param)[0]


def adapted_layer(in_features: int, widths: list[int], dtype: torch.dtype, ranks: dict[int, int], kernels):
    bounds = np.cumsum([0, *widths])
    slices = {f"part{i}": (int(bounds[i]), int(bounds[i + 1])) for i in range(len(widths))}
    base = torch.nn.Linear(in_features, sum(widths), bias=False).to(dtype)
    step = StepAdapters()
    step.kernels = kernels  # before the adapters attach: a bf16 model's stacks are made in bf16 for the kernel
    step.slots = {lora_id: slot for slot, lora_id in enumerate(ranks)}
    layer = LoRALinear(base, slices, step)
    adapters = {}
    for lora_id, r in ranks.items():
        parts = [(start, end, torch.randn(r, in_features) * 0.1, torch.randn(end - start, r) * 0.1, 1.5)
                 for i, (start, end) in enumerate(slices.values()) if not (lora_id == 2 and i == 0)]
        layer.set_adapter(lora_id, parts, dtype)
        adapters[lora_id] = parts
    return layer, step, adapters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,widths", [(64, [64, 32, 32]), (100, [37, 21]), (48, [200])])
@pytest.mark.parametrize("query_lens", [[1] * 23, [9, 1, 17, 3]])
@pytest.mark.parametrize("ranks", RANK_SETS)
def test_lora_add_equals_each_rows_product(kernels, dtype, in_features, widths, query_lens, ranks):
    torch.manual_seed(0)
    layer, step, adapters = adapted_layer(in_features, widths, dtype, RANK_SETS[ranks], kernels)
    assert (torch.bfloat16 in layer._stacks) == (dtype == torch.bfloat16)  # the kernel reads bf16 stacks there
    lora_ids = np.array([i % 4 for i in range(len(query_lens))])  # 0: the base model
    step.set(lora_ids, np.concatenate([[0], np.cumsum(query_lens)]))
    x = torch.randn(sum(query_lens), in_features).to(dtype)
    got = layer(x).double()
    expected = layer.base(x).double()
    row_lora = np.repeat(lora_ids, query_lens)
    for row, lora_id in enumerate(row_lora):
        for start, end, a, b, scale in adapters.get(int(lora_id), []):
            expected[row, start:end] += (x[row].double() @ a.double().t()) @ b.double().t() * scale
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the sum, and the base output's own, and A and B in bf16
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
    step.kernels = None  # the torch path the kernel replaces agrees
    torch.testing.assert_close(layer(x).double(), got, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_lora_add_refuses_rows_and_groups_out_of_range(kernels):
    out, x = torch.zeros(4, 8), torch.zeros(4, 8)
    a, b = torch.zeros(2, 8, 4), torch.zeros(2, 4, 8)
    parts = torch.tensor([[[0, 8, 0, 4]], [[0, 8, 0, 4]]])
    rows = torch.tensor([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="row 9 is out of range"):
        kernels.lora_add(out, x, a, b, parts, torch.tensor([0, 9]), torch.tensor([[0, 2, 0]]))
    with pytest.raises(RuntimeError, match="row 1 is listed twice"):
        kernels.lora_add(out, x, a, b, parts, torch.tensor([1, 1]), torch.tensor([[0, 1, 0], [1, 1, 1]]))
    with pytest.raises(RuntimeError, match="group 0 is out of range"):
        kernels.lora_add(out, x, a, b, parts, rows, torch.tensor([[0, 4, 2]]))
    with pytest.raises(RuntimeError, match="both float32 or both bf16"):
        kernels.lora_add(out, x, a.bfloat16(), b, parts, rows, torch.tensor([[0, 4, 0]]))
    with pytest.raises(RuntimeError, match="part 1 is out of range"):
        kernels.lora_add(out, x, a, b, torch.tensor([[[0, 8, 0, 4]], [[0, 9, 0, 4]]]), rows, torch.tensor([[0, 4, 0]]))
