"""The quantized linears' weights, as the layers hold them, kept on disk between starts.

Converting a GGUF file's blocks (or quantizing a float model at load) into the kernels' panels runs on one core and
grows with the model: seconds per GB at every start. A later start with the same source files, settings and
conversion code reads them back instead, as a copy from the page cache. The loaders then build each quantized weight
as a placeholder (QuantizedWeight.placeholder), which fusing, sharding and packing carry along as shapes, and
``restore`` fills the packed layers: QuantizedLinear's panels, or Int8GemmLinear's int8 values, which oneDNN packs
again (its packed layout depends on the CPU).

One entry per source, quantization, dtype and tensor-parallel rank: a safetensors file of each quantized layer's
tensors, whose metadata holds the key it was made under. Anything else in the key (the files' sizes and times, the
conversion code) rewrites the entry at the next start; an entry that does not fit the model is dropped and the model
converted again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import struct
import time
from pathlib import Path

import torch

from pagedllm.backends.cpu.runner.shard_loading import DTYPES, read_header
from pagedllm.backends.cpu.runner.sharding import Rank
from pagedllm.models.source import cache_dir

logger = logging.getLogger("pagedllm.cpu")

CACHED = ("gguf", "q4_0", "q8_0", "int8")
# The modules whose code decides what an entry holds: a change to any of them makes new entries.
CONVERSION_CODE = tuple(f"pagedllm.backends.cpu.{name}" for name in (
    "layers.quant_formats", "layers.quantized_linear", "layers.int8_gemm", "layers.fused_layers", "runner.gguf_loading",
    "runner.quantization", "runner.sharding", "runner.panel_cache"))


class StalePanels(Exception):
    """A cache entry whose layers do not fit the model built for it."""


@dataclasses.dataclass
class PanelCache:
    path: Path | None  # None: not cached (a quantization not in CACHED)
    key: dict
    hit: bool  # the entry is there under this key: the loaders make placeholders

    def missed(self) -> PanelCache:
        return dataclasses.replace(self, hit=False)


def open_panel_cache(name: str, sources: list[Path], quantization: str, dtype: torch.dtype, rank: Rank | None,
                     lora: bool) -> PanelCache:
    """The entry for the model ``name`` made from ``sources`` (the GGUF file, or the folder's files) with these
    settings."""
    if quantization not in CACHED:
        return PanelCache(None, {}, False)
    dtype_name = str(dtype).removeprefix("torch.")
    ranks = [rank.rank, rank.world_size] if rank is not None else [0, 1]
    files = [str(path.resolve()) for path in sources]
    key = {"sources": [[file, path.stat().st_size, path.stat().st_mtime_ns] for file, path in zip(files, sources)],
           "quantization": quantization, "dtype": dtype_name, "rank": ranks, "lora": lora, "code": _code_digest(),
           "torch": torch.__version__}
    where = hashlib.sha256(json.dumps([files, quantization, dtype_name, ranks]).encode()).hexdigest()[:16]
    path = cache_dir() / "panels" / f"{name}-{quantization}-{dtype_name}-{where}.safetensors"
    return PanelCache(path, key, _stored_key(path) == key)


def restore(cache: PanelCache, model: torch.nn.Module) -> None:
    """Give the model's packed quantized layers (built from placeholders) their tensors from the cache entry."""
    start = time.perf_counter()
    layers = dict(_quantized_layers(model))
    try:
        with open(cache.path, "rb") as entry:
            header, data_start = read_header(entry)
            stored = json.loads(header["__metadata__"]["layers"])
            if stored.keys() != layers.keys():
                raise StalePanels(f"it holds {len(stored)} quantized layers, the model has {len(layers)}")
            for name, layer in layers.items():
                layout, values, tensor_names = stored[name]
                if layout != layer.cache_layout():
                    raise StalePanels(f"layer {name} is {layout} there, {layer.cache_layout()} here")
                layer.restore_state({tensor: _read_tensor(entry, header[f"{name}.{tensor}"], data_start)
                                     for tensor in tensor_names}, values)
    except (OSError, KeyError, ValueError, struct.error) as exc:  # JSONDecodeError is a ValueError
        raise StalePanels(f"unreadable ({exc})") from exc
    logger.info("quantized weights of %d layers read from %s in %.2f s (no conversion)", len(layers), cache.path,
                time.perf_counter() - start)


def store(cache: PanelCache, model: torch.nn.Module) -> None:
    """Write the model's packed quantized layers' tensors as the cache entry (replaced whole, never half written)."""
    start = time.perf_counter()
    layers = list(_quantized_layers(model))
    tmp = cache.path.with_name(f"{cache.path.name}.tmp{os.getpid()}")
    try:
        cache.path.parent.mkdir(parents=True, exist_ok=True)
        _write_safetensors(tmp, layers, {"key": json.dumps(cache.key)})
        os.replace(tmp, cache.path)
    except OSError as exc:  # a full or read-only disk costs the next start a conversion, nothing else
        tmp.unlink(missing_ok=True)
        logger.warning("could not keep the quantized weights in %s for later starts: %s", cache.path, exc)
        return
    logger.info("quantized weights of %d layers kept in %s for later starts (%.0f MiB, %.2f s)", len(layers),
                cache.path, cache.path.stat().st_size / 2**20, time.perf_counter() - start)
    _drop_orphans(cache.path.parent)


_DTYPE_NAMES = {dtype: name for name, (dtype, _) in DTYPES.items()}  # for writing what shard_loading reads


def _write_safetensors(path: Path, layers: list, metadata: dict) -> None:
    """The layers' cache_state in safetensors' format, a layer's tensors made and written at a time: an
    Int8GemmLinear's int8 values are a copy out of oneDNN's layout, and all of them at once would double the
    weights' memory. The header comes first, so a first pass only notes their shapes."""
    header, layouts, offset = {}, {}, 0
    for name, layer in layers:
        state, values = layer.cache_state()
        layouts[name] = [layer.cache_layout(), values, list(state)]
        for tensor, value in state.items():
            header[f"{name}.{tensor}"] = {"dtype": _DTYPE_NAMES[value.dtype], "shape": list(value.shape),
                                          "data_offsets": [offset, offset + value.nbytes]}
            offset += value.nbytes
    header["__metadata__"] = {**metadata, "layers": json.dumps(layouts)}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for _, layer in layers:
            for value in layer.cache_state()[0].values():
                out.write(value.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def drop(cache: PanelCache) -> None:
    cache.path.unlink(missing_ok=True)


def _quantized_layers(model: torch.nn.Module):
    """QuantizedLinear and Int8GemmLinear layers: each says what it keeps (cache_state) and takes it back."""
    return ((name, module) for name, module in model.named_modules() if getattr(module, "is_quantized", False))


def _stored_key(path: Path) -> dict | None:
    """The key an entry was made under (its header alone is read), or None."""
    try:
        with open(path, "rb") as entry:
            return json.loads(read_header(entry)[0]["__metadata__"]["key"])
    except Exception:  # missing, half written by a crashed process, or not ours: as good as absent
        return None


def _read_tensor(entry, spec: dict, data_start: int) -> torch.Tensor:
    """One tensor read into memory of its own (not a mapping of the file: its pages would count as the process's
    memory beside the copy until the file is closed)."""
    tensor = torch.empty(spec["shape"], dtype=DTYPES[spec["dtype"]][0])
    first, end = spec["data_offsets"]
    if end - first != tensor.nbytes:
        raise ValueError(f"{end - first} bytes for a {spec['dtype']} tensor of shape {spec['shape']}")
    entry.seek(data_start + first)
    if tensor.nbytes and entry.readinto(tensor.reshape(-1).view(torch.uint8).numpy().data) != tensor.nbytes:
        raise ValueError("the file ends early")
    return tensor


def _drop_orphans(folder: Path) -> None:
    """Remove entries whose sources are gone (models deleted, a test's temporary folders)."""
    for path in folder.glob("*.safetensors"):
        key = _stored_key(path)
        if key is not None and not all(os.path.exists(source[0]) for source in key["sources"]):
            path.unlink(missing_ok=True)


def _code_digest() -> str:
    digest = hashlib.sha256()
    for module in CONVERSION_CODE:
        digest.update(Path(importlib.util.find_spec(module).origin).read_bytes())
    return digest.hexdigest()[:16]
