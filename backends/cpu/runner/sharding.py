"""Megatron-style sharding of a transformers Llama-family model for one tensor-parallel rank, in place.

q, k, v and gate, up are split by output rows (whole heads, whole MLP columns); o_proj and down_proj by input
columns, followed by a sum over the ranks (one all-reduce per attention block and one per MLP). The embedding and the
LM head are split by vocabulary: each rank looks up or scores its slice, the embedding's rows are summed and the
head's logits gathered on rank 0. Done before the layers are fused and packed, which then work on the shards.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagedllm.backends.common.memory import checkpoint_mappings, drop_checkpoint_pages, in_mappings
from pagedllm.backends.cpu.layers.quant_formats import QuantizedWeight, concatenate
from pagedllm.backends.cpu.layers.quantized_linear import attach, quantized_weight
from pagedllm.errors import ConfigError
from pagedllm.utils import cdiv

# Model types whose decoder layers hold q_proj/k_proj/v_proj/o_proj and gate_proj/up_proj/down_proj.
SHARDABLE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma"})


@dataclasses.dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    group: object = None  # the torch.distributed group of the ranks (None: the default one)

    def slice(self, total: int) -> tuple[int, int]:
        """This rank's part of ``total`` items split evenly (the caller checked divisibility)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size


def check_shardable(text_config, world_size: int) -> None:
    """ConfigError when the model cannot be split over ``world_size`` ranks, saying why."""
    model_type = text_config.model_type
    if model_type not in SHARDABLE:
        raise ConfigError(f"tensor parallelism supports {', '.join(sorted(SHARDABLE))}; this model is "
                          f"{model_type!r}: run it with --tensor-parallel-size 1")
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("KV heads", kv_heads),
                        ("MLP columns (intermediate_size)", text_config.intermediate_size)):
        if count % world_size:
            divisors = [d for d in range(1, count + 1) if count % d == 0 and d <= 64]
            raise ConfigError(f"--tensor-parallel-size {world_size} does not divide the model's {count} {what}: "
                              f"each rank needs a whole share; use one of {', '.join(map(str, divisors))}")


class RowParallel(torch.nn.Module):
    """A linear layer over this rank's input columns, summed over the ranks (bias added once, by rank 0)."""

    def __init__(self, linear: torch.nn.Linear, rank: Rank) -> None:
        super().__init__()
        start, end = rank.slice(linear.in_features)
        self.linear = _sliced(linear, (slice(None), slice(start, end)), bias=rank.rank == 0,
                              quantized=lambda w: w.columns(start, end))
        self.group = rank.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def column_parallel(linear: torch.nn.Linear, rank: Rank) -> torch.nn.Linear:
    """The rows of this rank's output features (its heads or MLP columns)."""
    start, end = rank.slice(linear.out_features)
    return _sliced(linear, slice(start, end), bias=True, quantized=lambda w: w.rows(slice(start, end)))


def _sliced(linear: torch.nn.Linear, index, bias: bool, quantized) -> torch.nn.Linear:
    """A new nn.Linear holding ``linear.weight[index]`` (its quantized weight through ``quantized``), with the bias
    sliced as the rows are when ``bias`` (else none)."""
    weight = quantized_weight(linear)
    shape = torch.empty(linear.weight.shape, device="meta")[index].shape
    rows = index if isinstance(index, slice) else index[0]
    part = torch.nn.Linear(shape[1], shape[0], bias=bias and linear.bias is not None, dtype=linear.weight.dtype,
                           device="meta" if weight is not None else None)
    with torch.no_grad():
        if weight is not None:
            try:
                attach(part, quantized(weight))
            except ValueError as exc:
                raise ConfigError(f"this --tensor-parallel-size splits quantized weights inside their blocks ({exc}): "
                                  "use another size, or --quantization none") from exc
        else:
            part.weight.copy_(linear.weight[index])
        if part.bias is not None:
            part.bias = torch.nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    return part


class VocabParallelEmbedding(torch.nn.Module):
    """This rank's rows of the embedding, looked up by ``lookup`` (an nn.Embedding of rows start..end, or the rank's
    slice of a quantized head: quantized_embedding.embed_from_head); tokens of other ranks' rows look up zeros, and
    the sum over the ranks is the full lookup."""

    def __init__(self, lookup: torch.nn.Module, start: int, end: int, rank: Rank) -> None:
        super().__init__()
        self.lookup, self.start, self.end, self.group = lookup, start, end, rank.group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(torch.nn.Module):
    """This rank's slice of the LM head (``linear``: head_slice); rank 0 gathers the slices into the full logits (the
    other ranks return their own slice, which nobody reads)."""

    def __init__(self, linear: torch.nn.Linear, vocab: int, rank: Rank) -> None:
        super().__init__()
        self.linear, self.vocab, self.rank = linear, vocab, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).contiguous()
        if self.rank.rank != 0:
            dist.gather(local, None, dst=0, group=self.rank.group)
            return local
        parts = [torch.empty_like(local) for _ in range(self.rank.world_size)]
        dist.gather(local, parts, dst=0, group=self.rank.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]


def head_slice(head: torch.nn.Linear, start: int, chunk: int, vocab: int, rows: QuantizedWeight | None = None,
               checkpoint: list[str] = ()) -> torch.nn.Linear:
    """The head's rows start..start + chunk as a Linear of ``chunk`` rows: slices are equal in size, the last one
    padded with rows that score zero, as gather needs. ``rows``: those rows of a quantized head, already read alone
    (a GGUF file's). Dense rows in a mapping of ``checkpoint`` stay a view of the file (packing copies them)."""
    end = min(start + chunk, vocab)
    weight = quantized_weight(head)
    if rows is None and weight is not None:
        rows = weight.rows(slice(start, end))
    part = torch.nn.Linear(head.in_features, chunk, bias=head.bias is not None, dtype=head.weight.dtype,
                           device="meta")
    with torch.no_grad():
        if rows is not None:  # the padding rows: zero values, scales and offsets
            attach(part, concatenate([rows, _zero_rows(rows, chunk - end + start)]))
        else:
            dense = _row_slice(head.weight, start, end, checkpoint, chunk)
            part.weight = torch.nn.Parameter(dense, requires_grad=False)
        if head.bias is not None:
            part.bias = torch.nn.Parameter(F.pad(head.bias[start:end], (0, chunk - end + start)), requires_grad=False)
    return part


def _row_slice(weight: torch.Tensor, start: int, end: int, checkpoint: list[str],
               padded_to: int = 0) -> torch.Tensor:
    """``weight``'s rows start..end, then zero rows up to ``padded_to``: a view where they lie in a mapping of
    ``checkpoint`` (file-backed, resident only where read), else a copy (a view would keep the whole table)."""
    rows = weight.detach()[start:end]
    padding = max(padded_to - (end - start), 0)
    if padding or not in_mappings(rows, checkpoint):
        rows = F.pad(rows, (0, 0, 0, padding))  # a copy, even unpadded
    return rows


def use_head_slice(model: torch.nn.Module, rows: QuantizedWeight, rank: Rank) -> QuantizedWeight:
    """Make the model's LM head this rank's VocabParallelHead over ``rows``, its vocabulary rows of the quantized
    head read (or quantized) alone; returns the slice's weight."""
    head = model.get_output_embeddings()
    vocab = head.out_features
    start, _, chunk = vocab_slice(vocab, rank)
    model.set_output_embeddings(VocabParallelHead(head_slice(head, start, chunk, vocab, rows), vocab, rank))
    return quantized_weight(model.get_output_embeddings().linear)


def _zero_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    return dataclasses.replace(weight, values=weight.values.new_zeros(rows, weight.values.shape[1]),
                               scales=weight.scales.new_zeros(rows, weight.scales.shape[1]),
                               offsets=weight.offsets.new_zeros(rows, weight.offsets.shape[1]),
                               multipliers=None if weight.multipliers is None else
                               weight.multipliers.new_zeros(rows, *weight.multipliers.shape[1:]))


def shard_model(model: torch.nn.Module, rank: Rank) -> None:
    """Replace ``model``'s layers by this rank's shards (see the module docstring). Each shard is a copy: the pages of
    a memory-mapped checkpoint that a layer's slices read go back after each layer."""
    checkpoint = checkpoint_mappings()
    decoder = model.get_decoder()
    for layer in decoder.layers:
        if not isinstance(layer.self_attn.o_proj, RowParallel):  # a GGUF file's layers are sharded as they are read
            shard_layer(layer, rank)
            drop_checkpoint_pages(checkpoint)
    vocab = model.config.get_text_config().vocab_size
    start, end, chunk = vocab_slice(vocab, rank)
    # a GGUF file's head and embedding are sharded as they are read; a tied head is the embedding's weight: first
    embedding, head = decoder.embed_tokens, model.lm_head
    if not isinstance(head, VocabParallelHead):
        model.lm_head = VocabParallelHead(head_slice(head, start, chunk, vocab, checkpoint=checkpoint), vocab, rank)
    if not isinstance(embedding, VocabParallelEmbedding):
        rows = _row_slice(embedding.weight, start, end, checkpoint)
        decoder.embed_tokens = VocabParallelEmbedding(torch.nn.Embedding.from_pretrained(rows), start, end, rank)
    drop_checkpoint_pages(checkpoint)


# A decoder layer's projections by block: split by output rows, then the one split by input columns.
LAYER_PROJECTIONS = {"self_attn": (("q_proj", "k_proj", "v_proj"), "o_proj"),
                     "mlp": (("gate_proj", "up_proj"), "down_proj")}


def shard_layer(layer: torch.nn.Module, rank: Rank) -> None:
    """One decoder layer's projections replaced by this rank's shards."""
    for part, (column_names, row_name) in LAYER_PROJECTIONS.items():
        block = getattr(layer, part)
        for name in column_names:
            setattr(block, name, column_parallel(getattr(block, name), rank))
        setattr(block, row_name, RowParallel(getattr(block, row_name), rank))


def vocab_slice(vocab: int, rank: Rank) -> tuple[int, int, int]:
    """(first, end) of this rank's rows of the vocabulary, and the rows of every rank's slice (the last one short)."""
    chunk = cdiv(vocab, rank.world_size)
    start = rank.rank * chunk
    return start, min(start + chunk, vocab), chunk


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights this rank holds (parameters and buffers such as packed weights)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


class LayerShards:
    """A tensor-parallel rank's decoder layers sharded as soon as a loader has given all their projections' tensors
    (GGUF files hold them layer by layer; quantization at load goes layer by layer), so that a rank never holds every
    layer whole. The quantized weights of a sharded layer are replaced by its shards in ``quantized`` (the names of
    row-parallel ones gain ``.linear``)."""

    def __init__(self, model: torch.nn.Module, rank: Rank) -> None:
        decoder = model.get_decoder()
        self.prefix = next(name for name, module in model.named_modules() if module is decoder) + ".layers"
        self.rank, self.layers = rank, decoder.layers
        self.pending: dict[int, set[str]] = {}  # per layer, its projections' parameters not given yet
        self.layer_of: dict[str, int] = {}
        for index, layer in enumerate(decoder.layers):
            for name, linear in self._projections(index, layer):
                for param_name, _ in linear.named_parameters():
                    self.pending.setdefault(index, set()).add(f"{name}.{param_name}")
                    self.layer_of[f"{name}.{param_name}"] = index

    def _projections(self, index: int, layer: torch.nn.Module):
        """(name, module) of the layer's projections, as they are now (whole or shards)."""
        for part, (column_names, row_name) in LAYER_PROJECTIONS.items():
            for projection in (*column_names, row_name):
                yield f"{self.prefix}.{index}.{part}.{projection}", getattr(getattr(layer, part), projection)

    def loaded(self, name: str, quantized: dict, linears: dict) -> None:
        """``name``'s tensor is in; when it was its layer's last, shard the layer (its whole linears leave
        ``linears`` too, so that nothing keeps them)."""
        index = self.layer_of.get(name)
        if index is None:
            return
        self.pending[index].discard(name)
        if self.pending[index]:
            return
        layer = self.layers[index]
        for full, linear in self._projections(index, layer):
            if full in quantized:
                attach(linear, quantized.pop(full))
            linears.pop(full, None)
        shard_layer(layer, self.rank)
        for full, module in self._projections(index, layer):
            row_parallel = isinstance(module, RowParallel)
            if (weight := quantized_weight(module.linear if row_parallel else module)) is not None:
                quantized[full + (".linear" if row_parallel else "")] = weight
