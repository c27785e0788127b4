"""Linear layers over weights packed once at load: bfloat16 ones as tile GEMMs through torch's brgemm where the
C++ kernels have it (AVX512_BF16, AMX), float32 ones (and bfloat16 without AVX512_BF16) through oneDNN's matmul.

nn.Linear goes to MKL's sgemm, which re-reads the plain [out, in] weight on every call, and in bf16 reorders it into
oneDNN's layout on every call; packing once saves that. oneDNN's matmul primitive still pays a cost per call that
dominates the small GEMMs of decode steps; brgemm's micro-kernels, called per block of columns, do not (see
docs/performance.md). The packed weight replaces the plain one, so the weights are held once; a head tied to the
embeddings keeps the embedding's copy and adds its packed one. Sums in another order: equal to nn.Linear to the
dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.common import cpu_features
from pagedllm.backends.common.memory import checkpoint_mappings, drop_checkpoint_pages
from pagedllm.backends.cpu.layers.int8_gemm import Int8GemmLinear, Int8GemmSiluAndMul, takes_int8_gemm
from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear, QuantizedSiluAndMul, quantized_weight
from pagedllm.errors import ConfigError
from pagedllm.utils import cdiv

# oneDNN picks its blocking for this many rows; decode batches are where the packing pays.
_ROWS_HINT = 64


BLOCK_COLUMNS = 64  # output columns per packed block in linear_bf16.cpp (kColumns)
# Wider inputs go to oneDNN: a block's weights (64 columns x in_features) and a row tile no longer stay in L2
# together, and oneDNN's blocking along the input wins (a Llama-1B down projection, 8192 wide: 0.64-0.74x).
MAX_BRGEMM_IN_FEATURES = 2048
# Set to True on a SwiGLU's concatenated gate and up projection (gate's columns first): its brgemm form returns
# silu(gate) * up instead, and has fuses_silu_and_mul = True.
SWIGLU_GATE_UP = "swiglu_gate_up"
# Under batch invariance oneDNN's matmul gets rows in multiples of this: one row takes its matrix-vector path, which
# sums in another order than its GEMM; from 4 rows up a row's sums do not depend on the rows beside it (the
# batch-invariance tests check this on every ISA kind they run on).
INVARIANT_ROW_MULTIPLE = 4


def padded_rows(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """x as [rows, in_features] with zero rows appended up to a multiple of ``multiple``, and the real row count."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % multiple
    return (F.pad(rows, (0, 0, 0, pad)) if pad else rows), m


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward over a oneDNN-packed weight (input and weight in the same dtype). With ``row_multiple``
    the rows are padded to a multiple of it (batch invariance)."""

    def __init__(self, linear: torch.nn.Linear, row_multiple: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.row_multiple = row_multiple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_multiple == 1:  # oneDNN takes the leading dimensions as rows itself: one op call, no reshape
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        rows, m = padded_rows(x, self.row_multiple)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out[:m].view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (f", rows padded to a multiple of {self.row_multiple}" if self.row_multiple > 1 else ""))


class BrgemmLinear(torch.nn.Module):
    """nn.Linear's forward in bfloat16 through the C++ kernels' brgemm tiles, over a weight in their block layout.
    With ``float_output`` it returns the float32 sums unrounded (the LM head: logits go to the sampler in float32)."""

    def __init__(self, linear: torch.nn.Linear, kernels) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", kernels.pack_linear_weight_bf16(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self._linear = kernels.linear_bf16
        self.float_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias, self.out_features, self.float_output)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", float32 output" if self.float_output else ""))


class BrgemmSiluAndMul(torch.nn.Module):
    """SwiGLU's gate and up projections (one nn.Linear, gate's columns first) and silu(gate) * up in one call:
    the weight is packed with blocks of gate and up columns alternating, and returns [..., width]."""

    fuses_silu_and_mul = True

    def __init__(self, gate_up: torch.nn.Linear, kernels) -> None:
        super().__init__()
        width = gate_up.out_features // 2
        self.in_features, self.out_features = gate_up.in_features, width
        self.register_buffer("weight", kernels.pack_linear_weight_bf16(_alternating(gate_up.weight.detach(), width)))
        self.register_buffer("bias", None if gate_up.bias is None else _alternating(gate_up.bias.detach(), width))
        self._forward = kernels.linear_silu_and_mul_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, width={self.out_features}, bias={self.bias is not None}"


def _alternating(gate_up: torch.Tensor, width: int, block: int = BLOCK_COLUMNS) -> torch.Tensor:
    """[gate; up] rows (or bias entries) as gate block 0, up block 0, gate block 1, ...; each half padded with zeros
    to whole blocks of the kernel's columns."""
    blocks = cdiv(width, block)
    halves = [torch.nn.functional.pad(half, (0, 0) * (half.dim() - 1) + (0, blocks * block - width))
              .reshape(blocks, block, *half.shape[1:]) for half in (gate_up[:width], gate_up[width:])]
    return torch.stack(halves, dim=1).reshape(2 * blocks * block, *gate_up.shape[1:])


def can_brgemm(linear: torch.nn.Linear, kernels, any_width: bool = False) -> bool:
    """bf16 weights of an even input width (brgemm takes pairs of bf16) up to MAX_BRGEMM_IN_FEATURES (any width
    with ``any_width``), with kernels built for AVX512_BF16."""
    return (kernels is not None and linear.weight.dtype == torch.bfloat16 and linear.in_features % 2 == 0
            and (any_width or linear.in_features <= MAX_BRGEMM_IN_FEATURES) and kernels.linear_bf16_available())


def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bfloat16 ones only with AVX-512 (its bf16 kernels need it)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return (cpu_features.rank(cpu_features.kernel_level()) >= cpu_features.rank("avx512")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def float32_logits(model: torch.nn.Module) -> bool:
    """Let a brgemm LM head return its float32 sums: the sampler wants float32, and rounding 49k logits to bf16
    first costs a copy per step and ties tokens whose logits differ by less than bf16's step."""
    head = model.get_output_embeddings()
    if not isinstance(head, (BrgemmLinear, QuantizedLinear, Int8GemmLinear)):
        return False
    head.float_output = True
    return True


def use_packed_linears(model: torch.nn.Module, kernels=None, batch_invariant: bool = False,
                       int8_activations: bool = False) -> dict[str, int]:
    """Swap every plain nn.Linear of the model for a QuantizedLinear where it carries a quantized weight, a
    BrgemmLinear where the kernels can run it (a BrgemmSiluAndMul for a SwiGLU's gate and up, marked with
    SWIGLU_GATE_UP), else for a PackedLinear where oneDNN packs its dtype here; returns how many of each
    ("quantized", "brgemm", "brgemm+silu", "oneDNN"). ``batch_invariant`` picks, for each, the form whose sums for
    a row do not depend on how many rows come with it: brgemm at any width (its tiles sum every row alike), oneDNN
    with padded rows, the quantized kernel at any row count. ``int8_activations``: quantized linears of a bf16
    model take int8 dot products for a decode step's rows (see QuantizedLinear)."""
    dtypes = {dtype for dtype in (torch.float32, torch.bfloat16) if can_pack(dtype)}
    counts = {"quantized": 0, "brgemm": 0, "brgemm+silu": 0, "oneDNN": 0}
    checkpoint = checkpoint_mappings()  # weights still viewing the files: each packed copy frees its original's pages
    names = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name in names:
        linear = model.get_submodule(name)
        # the LM head through brgemm at any width: it returns float32 logits (oneDNN's bf16 matmul rounds them)
        any_width = batch_invariant or linear is head
        if (weight := quantized_weight(linear)) is not None:
            bf16 = linear.weight.dtype == torch.bfloat16
            fused = getattr(linear, SWIGLU_GATE_UP, False)
            if takes_int8_gemm(weight, bf16, kernels):
                layer = (Int8GemmSiluAndMul if fused else Int8GemmLinear)(weight, linear.bias, kernels)
            else:
                layer = (QuantizedSiluAndMul if fused else QuantizedLinear)(
                    weight, linear.bias, kernels, bf16, int8_activations, kernel_only=batch_invariant)
            model.set_submodule(name, layer)
            counts["quantized"] += 1
        elif can_brgemm(linear, kernels, any_width=any_width):
            fused = getattr(linear, SWIGLU_GATE_UP, False)
            model.set_submodule(name, (BrgemmSiluAndMul if fused else BrgemmLinear)(linear, kernels))
            counts["brgemm+silu" if fused else "brgemm"] += 1
            drop_checkpoint_pages(checkpoint)
        elif linear.weight.dtype in dtypes:
            model.set_submodule(name, PackedLinear(linear, INVARIANT_ROW_MULTIPLE if batch_invariant else 1))
            counts["oneDNN"] += 1
            drop_checkpoint_pages(checkpoint)
    return counts


def check_batch_invariant(model: torch.nn.Module) -> None:
    """Refuse a model that still has a plain nn.Linear (bf16 on a CPU without AVX-512: neither oneDNN nor brgemm
    takes it), whose sums in torch's fallback GEMM depend on the batch."""
    plain = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    if plain:
        raise ConfigError(f"--batch-invariant: {len(plain)} linear layers ({plain[0]}, ...) have no batch-invariant "
                          f"kernel here ({str(model.dtype).removeprefix('torch.')} without AVX-512); run --dtype "
                          f"float32")
