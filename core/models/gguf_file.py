"""Opening a GGUF file with gguf's reader, a damaged file refused with a clear error instead of a numpy traceback."""

from __future__ import annotations

import struct
from pathlib import Path

from pagedllm.errors import ModelNotFoundError


def open_gguf(path: Path):
    """gguf's ``GGUFReader`` over ``path`` (memory-mapped read-only). A file cut short (a download interrupted) or
    otherwise damaged raises ``ModelNotFoundError`` naming it and what is wrong."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path), "r")
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as exc:
        raise ModelNotFoundError(f"{path} is truncated or damaged: gguf cannot read it ({exc}); fetch the file "
                                 f"again") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise ModelNotFoundError(f"{path} is truncated: its tensor {tensor.name} ends at byte {end}, past the "
                                     f"file's {size} bytes; fetch the file again")
    return reader
