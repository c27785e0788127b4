"""A step's commands as one fixed-size int64 header and one byte payload: the batch's flat arrays back to back,
so that a step crosses to the tensor-parallel workers as two buffers (no pickled object per request). What the
ranks exchange at start-up (the model's settings, each rank's report) crosses as JSON in byte tensors: no pickle,
which would run whatever a peer on the rendezvous sent.

The header says what the command is and every array's length; the payload holds the arrays in ``_BATCH_FIELDS``
order, each at an 8-byte aligned offset so that the receiver views them in place.
"""

from __future__ import annotations

import json

import numpy as np

from pagedllm.batch import Batch
from pagedllm.utils import cdiv

HEADER_LEN = 8
EXECUTE, COPY_BLOCKS, ALLOCATE, SHUTDOWN = 1, 2, 3, 4
# (field, dtype, shape from the header's (tokens, seqs, table width, sampled rows))
_BATCH_FIELDS = (
    ("input_ids", np.int64, lambda t, b, w, s: (t,)),
    ("positions", np.int64, lambda t, b, w, s: (t,)),
    ("slot_mapping", np.int64, lambda t, b, w, s: (t,)),
    ("logits_indices", np.int64, lambda t, b, w, s: (s,)),
    ("query_start_loc", np.int32, lambda t, b, w, s: (b + 1,)),
    ("num_computed", np.int32, lambda t, b, w, s: (b,)),
    ("seq_lens", np.int32, lambda t, b, w, s: (b,)),
    ("block_table", np.int32, lambda t, b, w, s: (b, w)),
)


def _padded(nbytes: int) -> int:
    return cdiv(nbytes, 8) * 8


def header(command: int, *values: int) -> np.ndarray:
    out = np.zeros(HEADER_LEN, dtype=np.int64)
    out[0] = command
    out[1:1 + len(values)] = values
    return out


def pack_batch(batch: Batch) -> tuple[np.ndarray, bytes]:
    """(header, payload) of one step."""
    table = batch.block_table
    head = header(EXECUTE, batch.num_tokens, batch.num_seqs, table.shape[1] if table.ndim == 2 else 0,
                  len(batch.logits_indices), batch.num_decodes, batch.block_size, 0)
    parts = []
    for name, dtype, _ in _BATCH_FIELDS:
        raw = np.ascontiguousarray(getattr(batch, name), dtype=dtype).tobytes()
        parts.append(raw + b"\0" * (_padded(len(raw)) - len(raw)))
    payload = b"".join(parts)
    head[7] = len(payload)
    return head, payload


def unpack_batch(head: np.ndarray, payload: np.ndarray) -> Batch:
    """The Batch of a header and payload (uint8); its arrays are views of the payload."""
    tokens, seqs, width, sampled, num_decodes, block_size = (int(v) for v in head[1:7])
    arrays, offset = {}, 0
    for name, dtype, shape in _BATCH_FIELDS:
        dims = shape(tokens, seqs, width, sampled)
        count = int(np.prod(dims))
        arrays[name] = payload[offset:offset + count * np.dtype(dtype).itemsize].view(dtype).reshape(dims)
        offset += _padded(count * np.dtype(dtype).itemsize)
    return Batch(**arrays, num_decodes=num_decodes, block_size=block_size)


def pack_copy_blocks(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, bytes]:
    pairs = np.stack([np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)])
    return header(COPY_BLOCKS, len(src), 0, 0, 0, 0, 0, pairs.nbytes), pairs.tobytes()


def unpack_copy_blocks(head: np.ndarray, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    pairs = payload.view(np.int64).reshape(2, int(head[1]))
    return pairs[0], pairs[1]


def broadcast_json(value, src: int, group):
    """Rank ``src``'s ``value`` (JSON-able) on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    data = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src, group=group)
    buffer = torch.empty(int(size), dtype=torch.uint8)
    if data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src, group=group)
    return json.loads(buffer.numpy().tobytes())


def all_gather_json(value, group=None) -> list:
    """Every rank's ``value`` (JSON-able), in rank order, on every rank."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(data)] = data
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(buffers, padded, group=group)
    return [json.loads(b[:int(s)].numpy().tobytes()) for b, s in zip(buffers, sizes)]
