"""The quantized layers' weights kept on disk between starts (runner/panel_cache.py): what a later start reads back is
the conversion made, bit for bit, for every format; a start with the same source and settings converts nothing and
still equals transformers; a changed source, or an entry that does not fit, is converted again."""

import os

import pytest
import torch
from test_cpu_quantized_linear import (dequantized_copy, gguf_blocks, greedy, prompts,  # noqa: F401 (a fixture)
                                       skip_without_int8_gemm)
from tiny_models import hf_greedy

from pagedllm import LLM
from pagedllm.backends.cpu.layers import quant_formats as qf
from pagedllm.backends.cpu.layers import quantized_linear
from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear
from pagedllm.backends.cpu.runner import panel_cache, quantization
from pagedllm.backends.cpu.runner.kernels import load_kernels


@pytest.fixture(scope="module")
def kernels():
    module, _ = load_kernels("kernel")
    return module


def layers_of(weights, kernels) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, weight in weights.items():
        model.add_module(name, QuantizedLinear(weight, None, kernels, bf16=False))
    return model


def buffers(model) -> dict:
    return {name: (tensor.dtype, tensor.shape, tensor.clone()) for name, tensor in model.named_buffers()}


def test_every_format_comes_back_bit_for_bit(kernels, tmp_path):
    """Zero points (no offsets stored), float16 scales and the K-quants' int8 factors with their multipliers: the
    placeholders' layers take the stored tensors, dtypes and zero points back."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    weights = {fmt.lower(): qf.from_gguf(gguf_blocks(fmt, 48, 512), fmt, 48, 512) for fmt in qf.GGUF_FORMATS}
    made = layers_of(weights, kernels)
    orphan = panel_cache.PanelCache(tmp_path / "panels" / "gone.safetensors", {"sources": [["/nonexistent", 1, 1]]},
                                    False)
    panel_cache.store(orphan, made)
    cache = panel_cache.PanelCache(tmp_path / "panels" / "model.safetensors", {"sources": [[str(source), 7, 1]]},
                                   False)
    panel_cache.store(cache, made)
    assert not orphan.path.exists()  # its source is gone: dropped when another entry is kept

    restored = layers_of({name: weight.placeholder(weight.out_features) for name, weight in weights.items()}, kernels)
    assert all(layer.values.is_meta for layer in restored.children())
    panel_cache.restore(cache, restored)
    expected, got = buffers(made), buffers(restored)
    assert expected.keys() == got.keys()
    for name, (dtype, shape, tensor) in expected.items():
        assert got[name][:2] == (dtype, shape) and torch.equal(got[name][2], tensor), name
    assert [layer.zero for layer in restored.children()] == [layer.zero for layer in made.children()]
    assert {layer.zero for layer in made.children()} == {0, 8, 128, 32}  # the symmetric formats' zero points

    del restored.q8_0
    with pytest.raises(panel_cache.StalePanels, match="6 quantized layers, the model has 5"):
        panel_cache.restore(cache, restored)


def test_a_second_start_converts_nothing_and_equals_transformers(tiny_llama, tmp_path, prompts, monkeypatch,  # noqa: F811
                                                                 isolated_cache_dir):
    """q4_0 quantized at load (the head q8_0), float32: the first start keeps its panels, the second builds only
    placeholders and reads them back. A source whose time changes, or an entry that does not fit the model, is
    converted again."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(isolated_cache_dir))
    expected = hf_greedy(dequantized_copy(tiny_llama, tmp_path / "q4_0", "q4_0"), prompts, 12)

    def start(converts: bool | None):
        """``converts``: whether the start must convert every weight, or none (None: either)."""
        def to_panels(weight):
            assert converts is None or weight.values.is_meta != converts, "converted" if not converts else "cached"
            return qf.to_panels(weight)

        with monkeypatch.context() as patch:
            patch.setattr(quantized_linear, "to_panels", to_panels)
            llm = LLM(str(tiny_llama), dtype="float32", quantization="q4_0", max_model_len=256, kv_cache_space=0.05,
                      enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=4)
        return llm

    assert greedy(start(converts=True), prompts) == expected
    assert greedy(start(converts=False), prompts) == expected

    (entry,) = (isolated_cache_dir / "panels").glob("*.safetensors")
    weights = tiny_llama / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        assert greedy(start(converts=True), prompts) == expected
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert greedy(start(converts=True), prompts) == expected  # the entry was rewritten for the changed time

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(entry), framework="pt") as stored:  # the right key, one layer short
        metadata = stored.metadata()
        tensors = {name: stored.get_tensor(name) for name in stored.keys() if not name.startswith("lm_head.")}
    save_file(tensors, str(entry), metadata=metadata)
    assert greedy(start(converts=None), prompts) == expected  # placeholders first, then the conversion
    assert greedy(start(converts=False), prompts) == expected


def test_int8_weights_come_back_packed_again(tiny_llama, prompts, monkeypatch, isolated_cache_dir):  # noqa: F811
    """W8A8 on a bf16 model: oneDNN's packed layout depends on the CPU, so the entry keeps the int8 values and a
    later start packs them again; it quantizes nothing (one row per weight, for the layout) and answers alike."""
    from pagedllm.backends.cpu.layers.int8_gemm import Int8GemmLinear

    skip_without_int8_gemm()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(isolated_cache_dir))

    def start():
        llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8", max_model_len=256, kv_cache_space=0.05)
        layers = {name: module for name, module in llm.engine.backend.runner.model.named_modules()
                  if isinstance(module, Int8GemmLinear)}
        assert len(layers) == 9
        return llm, {name: layer.packed.to_dense() for name, layer in layers.items()}

    first, packed = start()
    expected = greedy(first, prompts, 6)

    def one_row(weight, fmt):
        assert weight.shape[0] == 1, "a weight was quantized: it was in the cache"
        return qf.quantize(weight, fmt)

    with monkeypatch.context() as patch:
        patch.setattr(quantization, "quantize", one_row)
        second, again = start()
    assert packed.keys() == again.keys() and all(torch.equal(packed[name], again[name]) for name in packed)
    assert greedy(second, prompts, 6) == expected


def test_a_ranks_gguf_placeholders_take_its_shares_panels(kernels, tmp_path):
    """SmolLM2's GGUF at rank 1 of 2: the placeholders are sharded (each layer's rows or columns, the head's
    vocabulary half) as the converted weights are, so a rank's entry fits them, and the packed layers take its
    panels back bit for bit."""
    from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
    from pagedllm.backends.cpu.runner.gguf_loading import load_gguf_model
    from pagedllm.backends.cpu.runner.sharding import Rank
    from pagedllm.models.source import resolve_model

    source = resolve_model(None)

    def packed(placeholders: bool) -> torch.nn.Module:
        model, _ = load_gguf_model(str(source.config_dir), source.path, torch.float32, "sdpa",
                                   embedding_from_head=True, rank=Rank(1, 2), placeholders=placeholders)
        use_packed_linears(model, kernels)
        return model

    converted = packed(placeholders=False)
    cache = panel_cache.PanelCache(tmp_path / "rank1.safetensors", {"sources": [[str(source.path), 0, 0]]}, False)
    panel_cache.store(cache, converted)
    restored = packed(placeholders=True)
    assert all(layer.values.is_meta for _, layer in panel_cache._quantized_layers(restored))
    panel_cache.restore(cache, restored)
    expected = {name: layer.cache_state() for name, layer in panel_cache._quantized_layers(converted)}
    got = {name: layer.cache_state() for name, layer in panel_cache._quantized_layers(restored)}
    assert expected.keys() == got.keys() and len(got) == 30 * 7 + 1  # unfused: every projection, and the head
    for name, (tensors, values) in expected.items():
        assert got[name][1] == values and all(torch.equal(got[name][0][t], tensors[t]) for t in tensors), name
