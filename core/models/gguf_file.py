"""Reading a GGUF file's metadata and tensor index, a damaged file refused with a clear error.

gguf's ``GGUFReader`` makes a numpy view of every metadata item; a Llama-3 vocabulary's 400k strings cost it seconds
at every start. This reads the same layout with ``struct`` over a memory map, and hands the tensors out as that reader
shapes them (read-only views of the mapped file, quantized ones as [rows, bytes per row] uint8), sized by gguf's own
type table.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedllm.errors import ModelNotFoundError, UnsupportedModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_SCALARS = {kind: struct.Struct(fmt) for kind, fmt in
            {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
             12: "<d"}.items()}
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_DEFAULT_ALIGNMENT = 32
# tensor types read as typed values; every other one (BF16 included) stays bytes, as gguf's reader gives them
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: the fastest-moving dimension (columns) first
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a read-only view of the mapped file


@dataclass(frozen=True)
class GGUFFile:
    fields: dict  # key -> value (str, int, float, bool, or a list of them)
    tensors: list[GGUFTensor]


def open_gguf(path: Path, skip_prefixes: tuple[str, ...] = ()) -> GGUFFile:
    """``path``'s metadata and tensors (memory-mapped read-only). Keys starting with one of ``skip_prefixes`` are
    stepped over unread (a loader that takes its tokenizer elsewhere skips ``tokenizer.``). A file cut short (a
    download interrupted) or otherwise damaged raises ``ModelNotFoundError`` naming it and what is wrong; a tensor
    type newer than the installed ``gguf`` package, ``UnsupportedModelError``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        contents = _Parser(buffer, skip_prefixes).parse()
    except UnsupportedModelError:
        raise
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
        raise ModelNotFoundError(f"{path} is truncated or damaged: it cannot be read as GGUF ({exc}); fetch the "
                                 f"file again") from None
    size = len(buffer)
    for tensor in contents.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > size:
            raise ModelNotFoundError(f"{path} is truncated: its tensor {tensor.name} ends at byte {end}, past the "
                                     f"file's {size} bytes; fetch the file again")
    return contents


class _Parser:
    def __init__(self, buffer: mmap.mmap, skip_prefixes: tuple[str, ...]) -> None:
        self.buffer, self.skip_prefixes, self.offset = buffer, skip_prefixes, 0

    def parse(self) -> GGUFFile:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.buffer[:4] != _MAGIC:
            raise ValueError("no GGUF magic at its start")
        self.offset = 4
        version = self.unpack(_U32)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian files and versions other than 2 and 3 are not read)")
        tensor_count, field_count = self.unpack(_U64), self.unpack(_U64)
        fields = {}
        for _ in range(field_count):
            key = self.string()
            keep = not key.startswith(self.skip_prefixes)
            value = self.value(self.unpack(_U32), keep)
            if keep:
                fields[key] = value
        infos = []
        for _ in range(tensor_count):
            name = self.string()
            dims = tuple(self.unpack(_U64) for _ in range(self.unpack(_U32)))
            kind = self.unpack(_U32)
            if kind not in GGMLQuantizationType._value2member_map_:
                raise UnsupportedModelError(f"tensor {name} has GGML type {kind}, which the installed gguf package "
                                            f"does not know: upgrade it (pip install -U gguf)")
            infos.append((name, dims, GGMLQuantizationType(kind), self.unpack(_U64)))
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} is not a power of two")
        start = -(-self.offset // alignment) * alignment
        data = np.frombuffer(self.buffer, dtype=np.uint8)
        tensors = []
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(dims))
            n_bytes = elements * block_bytes // block
            begin = start + offset
            shape = tuple(reversed(dims))
            view = data[begin:begin + n_bytes]
            if kind.name in _PLAIN:
                view = view.view(_PLAIN[kind.name]).reshape(shape)
            else:
                view = view.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            tensors.append(GGUFTensor(name, kind, dims, n_bytes, begin, view))
        return GGUFFile(fields, tensors)

    def unpack(self, fmt: struct.Struct) -> int:
        (value,) = fmt.unpack_from(self.buffer, self.offset)
        self.offset += fmt.size
        return value

    def string(self, keep: bool = True) -> str | None:
        length = self.unpack(_U64)
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = self.buffer[self.offset:end].decode("utf-8") if keep else None
        self.offset = end
        return text

    def value(self, kind: int, keep: bool):
        if kind == _STRING:
            return self.string(keep)
        if kind == _ARRAY:
            item_kind, count = self.unpack(_U32), self.unpack(_U64)
            if item_kind in _SCALARS:  # one numpy read for the whole array
                dtype = np.dtype(_SCALARS[item_kind].format)
                items = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += dtype.itemsize * count
                return items.tolist() if keep else None
            items = [self.value(item_kind, keep) for _ in range(count)]
            return items if keep else None
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata type {kind}")
        return self.unpack(_SCALARS[kind])
