"""Block-quantized weights in the one layout the quantized kernels read (csrc/quantized_linear.cpp): every weight is
``scale * u + offset``, ``u`` an unsigned 4-bit, 5-bit, 6-bit or 8-bit value, with a float32 scale and offset per
group of 16 or 32 inputs of an output row. GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K blocks repack into it without
loss (the values they dequantize to are the same floats), and weights quantized at load (q8_0, q4_0, int8) are made
in it.

``dequantize`` is the pure torch reference the kernels are tested against.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import torch.nn.functional as F

# Inputs per packed chunk. 4 bits: 16 bytes, byte i holding input i (low nibble) and input i + 16 (high). 5 and 6
# bits: the low nibbles as a 4-bit chunk, then the high bits, bits - 4 of them per input: 4 or 8 bytes, byte b
# holding inputs from 8b or 4b on, input t of a byte at bit t * (bits - 4).
CHUNK = 32
GGUF_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
QUANTIZE_FORMATS = ("q8_0", "q4_0", "int8")
# bytes per block and inputs per block of each GGUF format
_BLOCKS = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256), "Q5_K": (176, 256),
           "Q6_K": (210, 256)}


SUPER = 256  # inputs per super-block of a K-quant: one float16 multiplier of its groups' integer scales


@dataclasses.dataclass
class QuantizedWeight:
    values: torch.Tensor  # uint8 [out, in * bits / 8]
    scales: torch.Tensor  # float32 [out, in / group]
    offsets: torch.Tensor  # float32 [out, in / group]
    bits: int
    group: int
    format: str  # where it came from: "Q4_K", "q8_0", ...
    # K-quants: float32 [out, in / SUPER, 2], the multipliers of each super-block's scales and offsets, which are
    # them times small integers; the panels keep those factors (fewer bytes). Dropped where a change of shape splits
    # a super-block: the scales and offsets alone are the weight.
    multipliers: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * 8 // self.bits

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, in torch."""
        u = unpack_values(self.values, self.bits).float()
        scales = self.scales.repeat_interleave(self.group, dim=1)
        offsets = self.offsets.repeat_interleave(self.group, dim=1)
        return u * scales + offsets

    def rows(self, index: slice | torch.Tensor) -> QuantizedWeight:
        """The given output rows (a tensor-parallel rank's share, or a permutation), in tensors of their own: a
        rank's share held as a view would keep the whole weight's storage alive."""
        def take(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            part = tensor[index]
            return part.clone() if part._is_view() else part.contiguous()

        return dataclasses.replace(self, values=take(self.values), scales=take(self.scales), offsets=take(self.offsets),
                                   multipliers=take(self.multipliers))

    def placeholder(self, rows: int) -> QuantizedWeight:
        """This weight's layout for ``rows`` output rows in meta tensors, for a weight whose panels come from the
        panel cache (runner/panel_cache.py): a row or two converted tells the layout, and fusing and sharding carry
        the shapes along."""
        def meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else torch.empty(rows, *tensor.shape[1:], dtype=tensor.dtype, device="meta")

        return dataclasses.replace(self, values=meta(self.values), scales=meta(self.scales),
                                   offsets=meta(self.offsets), multipliers=meta(self.multipliers))

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Inputs start..end (whole chunks and groups: a row-parallel rank's share)."""
        if start % CHUNK or end % CHUNK:
            raise ValueError(f"inputs {start}..{end} do not split the weight at whole chunks of {CHUNK}")
        bytes_per = self.bits / 8
        whole_supers = self.multipliers is not None and start % SUPER == 0 and end % SUPER == 0
        return dataclasses.replace(
            self, values=self.values[:, int(start * bytes_per):int(end * bytes_per)].contiguous(),
            scales=self.scales[:, start // self.group:end // self.group].contiguous(),
            offsets=self.offsets[:, start // self.group:end // self.group].contiguous(),
            multipliers=self.multipliers[:, start // SUPER:end // SUPER].contiguous() if whole_supers else None)

    def widened(self, bits: int, group: int) -> QuantizedWeight:
        """The same weights with more bits per value or smaller groups (to concatenate with another format)."""
        if bits == self.bits and group == self.group:
            return self
        values = self.values if bits == self.bits else pack_values(unpack_values(self.values, self.bits), bits)
        repeat = self.group // group
        return dataclasses.replace(self, values=values, bits=bits, group=group,
                                   scales=self.scales.repeat_interleave(repeat, dim=1),
                                   offsets=self.offsets.repeat_interleave(repeat, dim=1))


def concatenate(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Output rows of several weights stacked, in the widest layout among them (the fused q/k/v or gate/up)."""
    bits, group = max(w.bits for w in weights), min(w.group for w in weights)
    same = [w.widened(bits, group) for w in weights]
    formats = sorted({w.format for w in weights})
    factored = all(w.multipliers is not None for w in weights)
    return QuantizedWeight(torch.cat([w.values for w in same]), torch.cat([w.scales for w in same]),
                           torch.cat([w.offsets for w in same]), bits, group, "+".join(formats),
                           torch.cat([w.multipliers for w in same]) if factored else None)


def _high_shifts(bits: int, device: torch.device) -> torch.Tensor:
    """Where a 5-bit or 6-bit chunk's high bits sit in their bytes, by input (on the values' device: placeholders'
    are meta)."""
    return torch.arange(0, 8, bits - 4, dtype=torch.uint8, device=device)


def unpack_values(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [out, in] from the packed values."""
    if bits == 8:
        return values
    rows = values.shape[0]
    chunks = values.reshape(rows, -1, CHUNK * bits // 8)
    nibbles = chunks[..., :CHUNK // 2]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
    if bits == 4:
        return low.reshape(rows, -1)
    high = (chunks[..., CHUNK // 2:, None] >> _high_shifts(bits, values.device)) & ((1 << (bits - 4)) - 1)
    return (low | (high.reshape(low.shape) << 4)).reshape(rows, -1)


def pack_values(u: torch.Tensor, bits: int) -> torch.Tensor:
    """The packed form of uint8 values [out, in] (each below 2**bits)."""
    if bits == 8:
        return u.to(torch.uint8).contiguous()
    chunks = u.to(torch.uint8).reshape(u.shape[0], -1, CHUNK)
    packed = chunks[..., :CHUNK // 2] & 0x0F | ((chunks[..., CHUNK // 2:] & 0x0F) << 4)
    if bits in (5, 6):
        shifts = _high_shifts(bits, u.device)
        high = (chunks >> 4).reshape(*chunks.shape[:2], -1, len(shifts)) << shifts
        packed = torch.cat([packed, high.sum(-1, dtype=torch.uint8)], dim=-1)
    return packed.reshape(u.shape[0], -1).contiguous()


def _weight(values: np.ndarray, scales: np.ndarray, offsets: np.ndarray, rows: int, bits: int, group: int,
            fmt: str, multipliers: np.ndarray | None = None) -> QuantizedWeight:
    """A QuantizedWeight of ``values`` already packed as ``pack_values`` packs them."""
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, -1),
                           torch.from_numpy(scales.astype(np.float32)).reshape(rows, -1),
                           torch.from_numpy(offsets.astype(np.float32)).reshape(rows, -1), bits, group, fmt,
                           None if multipliers is None else
                           torch.from_numpy(multipliers.astype(np.float32)).reshape(rows, -1, 2))


def _packed(u: np.ndarray, rows: int, bits: int) -> np.ndarray:
    """Q5_K's or Q6_K's values (each below 2 ** bits) packed as ``pack_values`` packs them."""
    return pack_values(torch.from_numpy(np.ascontiguousarray(u)).reshape(rows, -1), bits).numpy()


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and minimums per super-block, from their 12 bytes."""
    packed = packed.reshape(-1, 3, 4)
    d, m, low = packed[:, 0], packed[:, 1], packed[:, 2]
    scale = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimum = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale.astype(np.float32), minimum.astype(np.float32)


# Bytes converted per pass (of GGUF blocks, or of values put in panels): a pass's temporaries stay below the mmap
# threshold that loading sets (runner/allocator.py), so passes reuse the heap's pages instead of faulting fresh ones
# in; a VM pays a host fault per page, and an LM head's whole-tensor temporaries cost seconds.
PIECE_BYTES = 512 << 10


def from_gguf(raw: np.ndarray, type_name: str, rows: int, in_features: int,
              placeholder: bool = False) -> QuantizedWeight:
    """A GGUF tensor's blocks ([rows, bytes per row] uint8, as open_gguf gives them) in the kernels' layout; with
    ``placeholder``, its layout alone (QuantizedWeight.placeholder), only the first row's blocks read."""
    if type_name not in GGUF_FORMATS:
        raise ValueError(f"GGUF type {type_name} is not one the quantized kernels run ({', '.join(GGUF_FORMATS)})")
    size, inputs = _BLOCKS[type_name]
    if in_features % inputs or raw.size != rows * in_features // inputs * size:
        raise ValueError(f"{raw.size} bytes of {type_name} blocks do not hold {rows} x {in_features} weights "
                         f"({rows * in_features // inputs * size} bytes in whole blocks of {inputs}): the file is "
                         "truncated or damaged")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1)
    if placeholder:
        return _from_blocks(blocks[:1], type_name).placeholder(rows)
    step = max(1, PIECE_BYTES // blocks.shape[1])
    first = _from_blocks(blocks[:step], type_name)
    if step >= rows:
        return first
    tensors = ("values", "scales", "offsets") + (() if first.multipliers is None else ("multipliers",))
    weight = dataclasses.replace(first, **{name: getattr(first, name).new_empty(rows, *getattr(first, name).shape[1:])
                                           for name in tensors})
    for start in range(0, rows, step):
        part = first if start == 0 else _from_blocks(blocks[start:start + step], type_name)
        for name in tensors:
            getattr(weight, name)[start:start + step] = getattr(part, name)
    return weight


def _from_blocks(blocks: np.ndarray, type_name: str) -> QuantizedWeight:
    """``from_gguf`` of some whole rows of blocks ([rows, bytes per row])."""
    rows = blocks.shape[0]
    if type_name == "Q8_0":
        b = blocks.reshape(-1, 34)
        d = _half(b[:, :2])
        u = b[:, 2:] ^ np.uint8(0x80)  # int8 x as x + 128
        return _weight(u, d, -128 * d, rows, 8, 32, type_name)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        b = blocks.reshape(-1, size)
        d = _half(b[:, :2])
        offset = -8 * d if type_name == "Q4_0" else _half(b[:, 2:4])
        return _weight(b[:, size - 16:], d, offset, rows, 4, 32, type_name)  # their 16 bytes are a packed chunk
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        b = blocks.reshape(-1, size)
        d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
        scale, minimum = _k_scale_min(b[:, 4:16])
        qs = b[:, size - 128:].reshape(-1, 4, 2, 16)  # 64 inputs per 32 bytes: i in the low nibbles, 32 + i high
        multipliers = np.concatenate([d, -dmin], axis=-1)  # scale = d * scale factor, offset = -dmin * minimum
        if type_name == "Q4_K":  # each 32 inputs as a packed chunk: i low, 16 + i high
            low, high = qs[:, :, 0], qs[:, :, 1]
            u = np.stack([(low & 0x0F) | (high << 4), (low >> 4) | (high & 0xF0)], axis=2)
            return _weight(u, d * scale, -(dmin * minimum), rows, 4, 32, type_name, multipliers)
        u = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        u = u.reshape(-1, 8, 32) | ((qh & 1) << 4)
        return _weight(_packed(u, rows, 5), d * scale, -(dmin * minimum), rows, 5, 32, type_name, multipliers)
    # Q6_K: 6-bit values, signed around 32, with an int8 scale per 16 inputs.
    b = blocks.reshape(-1, 210)
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _half(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    u = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)
    scale = d * scales.copy().view(np.int8).astype(np.float32)
    return _weight(_packed(u, rows, 6), scale, -32 * scale, rows, 6, 16, type_name, np.concatenate([d, d], axis=-1))


# Rows quantized per pass: the float32 temporaries are a few times this many rows, not the whole weight's (a Llama-3
# head's would be several GB on the way up).
ROWS_PER_PASS = 4096


def quantize(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """A float weight [out, in] (in a multiple of 32) quantized at load: q8_0 and q4_0 as GGUF's quantizer rounds
    them, int8 as symmetric per-output-row int8 (vLLM CPU's W8A8 weights). Every format's rows are independent."""
    parts = [_quantize_rows(weight[i:i + ROWS_PER_PASS], fmt) for i in range(0, weight.shape[0], ROWS_PER_PASS)]
    return parts[0] if len(parts) == 1 else concatenate(parts)


def _quantize_rows(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    w = weight.detach().float()
    rows, k = w.shape
    if k % CHUNK:
        raise ValueError(f"{k} inputs are not whole blocks of {CHUNK}")
    blocks = w.reshape(rows, -1, CHUNK)
    if fmt in ("q8_0", "int8"):
        amax = blocks.abs().amax(-1, keepdim=True) if fmt == "q8_0" else w.abs().amax(-1).reshape(rows, 1, 1)
        d = amax / 127
        scaled = blocks * torch.where(d == 0, 0, 1 / d)
        q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).clamp(-127, 127)  # C's roundf, as GGUF's
        if fmt == "q8_0":
            d = d.half().float()  # GGUF stores the block scale in float16
        d = d.expand(rows, k // CHUNK, 1).reshape(rows, -1)
        u = (q + 128).to(torch.uint8).reshape(rows, k)
        return QuantizedWeight(pack_values(u, 8), d.contiguous(), (-128 * d).contiguous(), 8, CHUNK, fmt)
    if fmt == "q4_0":
        index = blocks.abs().argmax(-1, keepdim=True)
        d = torch.gather(blocks, -1, index) / -8
        u = torch.trunc(blocks * torch.where(d == 0, 0, 1 / d) + 8.5).clamp(0, 15).to(torch.uint8).reshape(rows, k)
        d = d.half().float().reshape(rows, -1)
        return QuantizedWeight(pack_values(u, 4), d.contiguous(), (-8 * d).contiguous(), 4, CHUNK, fmt)
    raise ValueError(f"unknown quantization {fmt!r}: use one of {', '.join(QUANTIZE_FORMATS)}")


PANEL = 16  # output columns per panel of the kernels' layout (csrc/quantized_weights.h)


@dataclasses.dataclass
class PanelWeight:
    """A QuantizedWeight as the kernels read it: its columns in panels of 16 stored side by side, so that one 64-byte
    load holds the same inputs of 16 columns (csrc/quantized_weights.h describes the order inside a load)."""

    values: torch.Tensor  # uint8 [panels, in * 16 * bits / 8]
    scales: torch.Tensor  # float32 or float16 [panels, groups, 16], or int8 factors of the multipliers
    offsets: torch.Tensor  # the same, or empty where they are -zero * scale
    multipliers: torch.Tensor  # factored: float32 [panels, in / SUPER, 2 (scales', offsets'), 16]; else empty
    bits: int
    group: int
    zero: int  # symmetric formats' zero point (offset = -zero * scale), else 0
    format: str
    out_features: int

    @property
    def in_features(self) -> int:
        return self.values.shape[1] * 8 // self.bits // PANEL

    @property
    def nbytes(self) -> int:
        """The bytes it holds: values, scales, offsets and multipliers."""
        return sum(t.nbytes for t in (self.values, self.scales, self.offsets, self.multipliers))

    @property
    def layout(self) -> tuple:
        """The weight's first arguments of every quantized kernel."""
        return self.values, self.scales, self.offsets, self.multipliers, self.bits, self.group, self.zero

    @property
    def arguments(self) -> tuple:
        """The layout and the column count: the first arguments of the kernels that take both."""
        return *self.layout, self.out_features


# Each lane's bytes are reordered as whole 64-bit words (a column's 8 inputs at 4 bits, two groups of 4 at 8 bits)
# with shifts and masks: contiguous integer ops, several times faster than a strided byte gather.
_LOW_BYTES_OF_EACH_HALF = 0x0F0F00000F0F
_BYTES_0_AND_3 = 0xFF0000FFFF0000FF - (1 << 64)  # as a signed int64


def _lanes_4bit(u: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """Panels' bytes of 4-bit values u [count * 16, k]: per 8 inputs of a column, bytes
    0 | 2 << 4, 4 | 6 << 4, 1 | 3 << 4, 5 | 7 << 4."""
    x = u.view(torch.int64).reshape(count, PANEL, k // 8).transpose(1, 2).contiguous()
    pairs = (x & _LOW_BYTES_OF_EACH_HALF) | (((x >> 16) & _LOW_BYTES_OF_EACH_HALF) << 4)  # bytes 0, 1, 4, 5 hold them
    lanes = (pairs & 0xFF) | ((pairs >> 24) & 0xFF00) | ((pairs << 8) & 0xFF0000) | ((pairs >> 16) & 0xFF000000)
    return lanes.to(torch.int32).view(torch.uint8).reshape(count, -1)


def _lanes_8bit(u: torch.Tensor, count: int, k: int) -> torch.Tensor:
    """Panels' bytes of 8-bit values u [count * 16, k]: per 4 inputs of a column, inputs 0, 2, 1, 3."""
    x = u.view(torch.int32).reshape(count, PANEL, k // 4).transpose(1, 2).contiguous().view(torch.int64)
    lanes = (x & _BYTES_0_AND_3) | ((x << 8) & 0x00FF000000FF0000) | ((x >> 8) & 0x0000FF000000FF00)
    return lanes.view(torch.uint8).reshape(count, -1)


_NIBBLE_OF_INPUT = (0, 4, 1, 5, 2, 6, 3, 7)  # which nibble of a 4-bit lane holds each of its 8 inputs


def _high_bit(bits: int, j: int, n: int) -> int:
    """5 and 6 bits: where the high bits of nibble n of load j of a unit start in the unit's 32-bit word of them
    (quantized_weights.h's high_bit)."""
    return 8 * (n // 2) + (4 * (1 - j) + 2 * (n % 2) if bits == 6 else 2 * j + n % 2)


def _lanes_with_high_bits(u: torch.Tensor, count: int, k: int, bits: int) -> torch.Tensor:
    """Panels' bytes of 5-bit or 6-bit values u [count * 16, k]: per unit of 32 or 16 inputs, the low nibbles of each
    8 inputs as a 4-bit load, then a 32-bit word per column of their high bits."""
    loads = {5: 4, 6: 2}[bits]  # per unit
    shifts = torch.tensor([[_high_bit(bits, j, n) for n in _NIBBLE_OF_INPUT] for j in range(loads)])
    low = _lanes_4bit(u & 0x0F, count, k).reshape(count, k // (8 * loads), loads * 64)
    high = (u >> 4).to(torch.int64).reshape(count, PANEL, k // (8 * loads), loads, 8) << shifts
    words = high.sum((-1, -2)).transpose(1, 2).to(torch.int32).contiguous().view(torch.uint8)
    return torch.cat([low, words], dim=-1).reshape(count, -1)


def _lanes(u: torch.Tensor, count: int, k: int, bits: int) -> torch.Tensor:
    if bits in (5, 6):
        return _lanes_with_high_bits(u, count, k, bits)
    return _lanes_4bit(u, count, k) if bits == 4 else _lanes_8bit(u, count, k)


def to_panels(weight: QuantizedWeight) -> PanelWeight:
    """``weight`` in panels of 16 columns (the last one padded with zero columns), converted a few panels at a time
    (PIECE_BYTES), scales and offsets too, so that an LM head's conversion holds little more than its result."""
    n, k, bits = weight.out_features, weight.in_features, weight.bits
    panels, groups = -(-n // PANEL), weight.scales.shape[1]
    if weight.values.is_meta:  # a placeholder: the panel cache gives the layer its panels once the model is packed
        meta = functools.partial(torch.empty, device="meta")
        return PanelWeight(meta(panels, k * PANEL * bits // 8, dtype=torch.uint8), meta(panels, groups, PANEL),
                           meta(panels, groups, PANEL), meta(0), bits, weight.group, 0, weight.format, n)
    values = torch.empty(panels, k * PANEL * bits // 8, dtype=torch.uint8)
    scales, offsets = torch.empty(panels, groups, PANEL), torch.empty(panels, groups, PANEL)
    # symmetric formats (Q4_0: 8, Q8_0 and int8: 128, Q6_K: 32) need no offsets; GGUF's float16 scales half the bytes
    symmetric = {z: True for z in (8, 128, 32) if z < 2 ** bits}
    halves = True
    # K-quants: int8 factors of their super-blocks' multipliers, a quarter of float32's bytes
    factored = weight.multipliers is not None and k % SUPER == 0
    exact = [factored, factored]  # whether the scales' and the offsets' factors give them back
    if factored:
        factors = torch.empty(2, panels, groups, PANEL, dtype=torch.int8)
        multipliers = torch.empty(panels, k // SUPER, 2, PANEL)
    step = max(1, PIECE_BYTES // (PANEL * k))
    for first in range(0, panels, step):
        rows = slice(first * PANEL, min(n, (first + step) * PANEL))
        count = min(step, panels - first)
        padding = count * PANEL - (rows.stop - rows.start)
        u = unpack_values(weight.values[rows], bits)
        if padding:
            u = F.pad(u, (0, 0, 0, padding))
        values[first:first + count] = _lanes(u, count, k, bits)
        scale, offset = (F.pad(t[rows], (0, 0, 0, padding)) for t in (weight.scales, weight.offsets))
        scales[first:first + count] = scale.reshape(count, PANEL, groups).transpose(1, 2)
        offsets[first:first + count] = offset.reshape(count, PANEL, groups).transpose(1, 2)
        for z in symmetric:
            symmetric[z] = symmetric[z] and torch.equal(offset, -z * scale)
        halves = halves and all(torch.equal(t.half().float(), t) for t in (scale, offset))
        if factored:
            multiplier = F.pad(weight.multipliers[rows], (0, 0, 0, 0, 0, padding))  # [count * 16, supers, 2]
            per_group = multiplier.repeat_interleave(SUPER // weight.group, dim=1)
            for i, table in enumerate((scale, offset)):
                factor, equal = _factors(table, per_group[..., i])
                exact[i] = exact[i] and equal
                factors[i, first:first + count] = factor.reshape(count, PANEL, groups).transpose(1, 2)
            multipliers[first:first + count] = multiplier.reshape(count, PANEL, -1, 2).permute(0, 2, 3, 1)
    zero = next((z for z, equal in symmetric.items() if equal), 0)
    factored = exact[0] and (exact[1] or zero > 0)  # a zero point's offsets are not stored
    if factored:
        scales, offsets = factors
    elif halves:
        scales, offsets = scales.half(), offsets.half()
    if zero:
        offsets = scales.new_empty(panels, 0, PANEL)
    if not factored:
        multipliers = torch.empty(0)
    return PanelWeight(values, scales, offsets, multipliers, bits, weight.group, zero, weight.format, n)


def _factors(table: torch.Tensor, multiplier: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``table`` (scales or offsets) over ``multiplier`` as int8, and whether their products give it back exactly."""
    factor = torch.where(multiplier == 0, 0, table / multiplier).round().clamp(-128, 127)
    return factor.to(torch.int8), torch.equal(factor * multiplier, table)
