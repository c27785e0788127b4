"""A GGUF file's model made without its dense weights: the model is built with empty parameters (accelerate's
init_empty_weights), each linear layer whose tensor is in a format the quantized kernels run gets the file's blocks
as they are (quant_formats.from_gguf), and every other tensor (embeddings, norms, linears of other types) is
dequantized into its parameter. Memory holds the quantized model, never the dense one that transformers' GGUF
loader makes (for an 8B model in bf16, 16 GB instead of about 5).
"""

from __future__ import annotations

import collections
import functools
import logging
from pathlib import Path

import numpy as np
import torch

from pagedllm.backends.common.memory import drop_mapped_pages
from pagedllm.backends.cpu.layers.quant_formats import GGUF_FORMATS, QuantizedWeight, from_gguf
from pagedllm.backends.cpu.layers.quantized_linear import attach
from pagedllm.backends.cpu.runner.sharding import (LayerShards, Rank, VocabParallelEmbedding, use_head_slice,
                                                   vocab_slice)
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.gguf_file import open_gguf

logger = logging.getLogger("pagedllm.cpu")


def load_gguf_model(config_dir: str, gguf_file: Path, dtype: torch.dtype, attn_implementation: str,
                    embedding_from_head: bool = False, rank: Rank | None = None, placeholders: bool = False):
    """(model, {linear name: QuantizedWeight attached to it}) from the GGUF file, with the config (and
    generation config) of ``config_dir``. With ``embedding_from_head``, a plain token embedding tied to a quantized
    head is left on the meta device, for quantized_embedding.embed_from_head to look up in the head's panels. A
    tensor-parallel ``rank`` reads only its own rows of the vocabulary (sharding.VocabParallelHead and
    VocabParallelEmbedding; a dense embedding's rows dequantized alone): the whole head and table are the largest
    things a rank would otherwise hold on the way up. With ``placeholders``, the quantized weights are their layouts
    alone (QuantizedWeight.placeholder), for the panel cache to fill."""
    from accelerate import init_empty_weights
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with init_empty_weights():  # parameters on the meta device; buffers (RoPE's frequencies) made for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    reader = open_gguf(gguf_file, skip_prefixes=("tokenizer.",))  # the tokenizer comes from config_dir
    processor, to_hf = _name_mapping(reader, model)
    linears = {name: module for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    head = model.get_output_embeddings()
    head_name = next((name for name, linear in linears.items() if linear is head), None)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False) and head_name is not None
    quantized, dense_types = {}, collections.Counter()
    head_quantized = False
    lookup_in_head = embedding_from_head and type(model.get_input_embeddings()) is torch.nn.Embedding
    start = end = embedding_name = None
    if rank is not None:
        start, end, _ = vocab_slice(config.get_text_config().vocab_size, rank)
        embedding_name = next((name for name, param in model.named_parameters()
                               if param is model.get_input_embeddings().weight), None)
    layer_shards = LayerShards(model, rank) if rank is not None else None
    for tensor in reader.tensors:
        hf_name = to_hf.get(tensor.name)
        if hf_name is None:
            continue
        # a tied head first: whether it takes the file's blocks decides whether the embedding needs dense rows
        names = ([head_name + ".weight"] if tied and hf_name.endswith("embed_tokens.weight") else []) + [hf_name]
        for name in names:
            linear = linears.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
            sliced = linear is head and rank is not None  # a rank reads its vocabulary rows of the head alone
            if linear is not None and (weight := _quantized(tensor, linear, processor, gguf_file,
                                                            (start, end) if sliced else None,
                                                            placeholders)) is not None:
                head_quantized = head_quantized or linear is head
                if sliced:
                    linears.pop(head_name)
                    name, weight = head_name + ".linear.weight", use_head_slice(model, weight, rank)
                quantized[name.removesuffix(".weight")] = weight
                if layer_shards is not None:
                    layer_shards.loaded(name, quantized, linears)
                continue
            if linear is head and tied and name != hf_name:
                continue  # the head shares the embedding's dense rows (tie_weights below)
            if name == hf_name and len(names) > 1 and head_quantized and lookup_in_head:
                continue
            if name == embedding_name and (head_quantized or not tied):
                # a head tied to it as dense rows would need the whole table: not here
                rows = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data[start:end], tensor.tensor_type)))
                model.get_decoder().embed_tokens = VocabParallelEmbedding(
                    torch.nn.Embedding.from_pretrained(rows.to(dtype)), start, end, rank)
                continue
            values = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name).weights
            # float tensors come back as views of the read-only mapped file: copied as they become the dtype
            _set_tensor(model, name, torch.tensor(values).to(dtype) if not values.flags.writeable
                        else torch.from_numpy(np.ascontiguousarray(values)).to(dtype))
            if linear is not None:
                dense_types[tensor.tensor_type.name] += 1
            if layer_shards is not None:
                layer_shards.loaded(name, quantized, linears)
        # read: the file's pages would otherwise stay in this process's resident memory until the whole file was
        # read, beside everything made of them
        drop_mapped_pages(tensor.data)
    for name, weight in quantized.items():
        if name in linears:  # not a layer LayerShards sharded (it attached theirs)
            attach(linears[name], weight)
    if tied and not head_quantized:
        head.weight = model.get_input_embeddings().weight
    # left for the head's panels (embed_from_head); a rank's, for its slice of them
    embedding = model.get_input_embeddings().weight if lookup_in_head and head_quantized else None
    if embedding is not None and rank is not None:
        model.get_decoder().embed_tokens = VocabParallelEmbedding(model.get_input_embeddings(), start, end, rank)
    empty = [name for name, param in model.named_parameters()
             if param.is_meta and name.removesuffix(".weight") not in quantized and param is not embedding]
    if empty:
        raise UnsupportedModelError(f"{gguf_file}: no tensor for {', '.join(empty[:3])}"
                                    f"{' ...' if len(empty) > 3 else ''} (an architecture transformers maps "
                                    f"differently?); run it with --quantization none")
    if dense_types:
        logger.info("GGUF linear layers left dense (no quantized kernel for their type): %s",
                    ", ".join(f"{n} {kind}" for kind, n in sorted(dense_types.items())))
    model.generation_config = _generation_config(config_dir, model.generation_config)
    return model.eval(), quantized


def _name_mapping(reader, model):
    """transformers' tensor processor for the file's architecture (it permutes Llama's q and k rows) and its map
    from GGUF tensor names to the model's parameter names."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture = reader.fields["general.architecture"]
    text = model.config.get_text_config()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config={
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads})
    # transformers builds gguf's name map for the same architecture again at every submodule (~400 for SmolLM2, two
    # seconds of start-up): one map serves them all.
    import gguf

    build_map = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build_map)
    try:
        return processor, get_gguf_hf_weights_map(model, processor)
    finally:
        gguf.get_tensor_name_map = build_map


def _quantized(tensor, linear: torch.nn.Linear, processor, gguf_file: Path,
               row_range: tuple[int, int] | None = None, placeholder: bool = False) -> QuantizedWeight | None:
    """The tensor's blocks in the kernels' layout, rows in the Hugging Face order (the processor's permutation of
    whole rows), or None for a type or shape the kernels do not take. ``row_range``: only rows first..end (of an
    unpermuted tensor: a rank's slice of the LM head)."""
    type_name = tensor.tensor_type.name
    rows, columns = int(tensor.shape[-1]), int(tensor.shape[0])
    if type_name not in GGUF_FORMATS or (rows, columns) != (linear.out_features, linear.in_features):
        return None
    order = processor.process(weights=np.arange(rows).reshape(rows, 1), name=tensor.name).weights.reshape(rows)
    first, end = row_range or (0, rows)
    if row_range is not None and not np.array_equal(order[first:end], np.arange(first, end)):
        raise UnsupportedModelError(f"{gguf_file}: tensor {tensor.name}: rows permuted where a rank reads a slice")
    try:
        weight = from_gguf(np.asarray(tensor.data[first:end]), type_name, end - first, columns, placeholder)
    except ValueError as exc:
        raise UnsupportedModelError(f"{gguf_file}: tensor {tensor.name}: {exc}") from exc
    if row_range is None and not placeholder and not np.array_equal(order, np.arange(rows)):
        weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
    return weight


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, attr)
    if tuple(current.shape) != tuple(value.shape):
        raise UnsupportedModelError(f"GGUF tensor for {name} has shape {tuple(value.shape)}, the model expects "
                                    f"{tuple(current.shape)}")
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def _generation_config(config_dir: str, default):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(config_dir)
    except OSError:
        return default
