"""A tensor-parallel rank's model without the whole model in memory: built on the meta device, its parameters then
point into the safetensors files, memory-mapped (private, copy-on-write), so that sharding copies out only this
rank's rows or columns and nothing else of a weight is ever read into the process's own memory.

Loading the whole model first, as one process does, would make each of N ranks hold all the weights on the way up:
an 8B bf16 model at TP=2 would need 32 GB at load instead of 16 GB.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from pagedllm.errors import ModelNotFoundError

# safetensors' dtype names, and numpy types of the same width to map their bytes through
DTYPES = {"BF16": (torch.bfloat16, np.int16), "F16": (torch.float16, np.float16), "F32": (torch.float32, np.float32),
           "F64": (torch.float64, np.float64), "I64": (torch.int64, np.int64), "I32": (torch.int32, np.int32),
           "I8": (torch.int8, np.int8), "U8": (torch.uint8, np.uint8), "BOOL": (torch.bool, np.bool_)}


def read_header(f) -> tuple[dict, int]:
    """A safetensors file's header (its tensors and ``__metadata__``) and where its data starts."""
    (header_len,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(header_len)), 8 + header_len


def has_safetensors(folder: str) -> bool:
    return any(Path(folder).glob("*.safetensors"))


class SafetensorsViews:
    """Every tensor of a folder's safetensors files as a CPU tensor over a private memory map of its file."""

    def __init__(self, folder: str) -> None:
        self._where: dict[str, tuple[np.ndarray, dict]] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with open(path, "rb") as f:
                header, data_start = read_header(f)
                region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view, the file untouched
            data = np.frombuffer(region, dtype=np.uint8, offset=data_start)
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = (data, info)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def tensor(self, name: str) -> torch.Tensor:
        data, info = self._where[name]
        if info["dtype"] not in DTYPES:
            raise ModelNotFoundError(f"tensor {name}: safetensors dtype {info['dtype']} is not one pagedllm reads")
        dtype, np_type = DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        raw = data[start:end].view(np_type)
        return torch.from_numpy(raw).view(dtype).reshape(info["shape"])


def meta_model_over_files(model_dir: str, dtype: torch.dtype, attn_implementation: str) -> torch.nn.Module:
    """The model with its parameters over the files' tensors (in the files' dtype; ``to_dtype`` casts them once
    they are sharded). A tied LM head shares the embedding's tensor, as the checkpoint has only that."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights():  # parameters on the meta device; buffers (RoPE's frequencies) made for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    views = SafetensorsViews(model_dir)
    tied = {id(model.get_output_embeddings().weight)} if model.get_output_embeddings() is not None else set()
    embedding_name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            key = full if full in views else embedding_name if id(param) in tied else None
            if key is None or key not in views:
                raise ModelNotFoundError(f"{model_dir}: the safetensors files have no tensor {full}")
            module._parameters[name] = torch.nn.Parameter(views.tensor(key), requires_grad=False)
    model.eval()
    return model


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the parameters that are not ``dtype`` yet (the sharded copies, the norms' views), one at a time."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
