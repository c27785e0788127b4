"""Loading on the openvino backend: the export cache, optimum-cli folders, settings, bad input, availability."""

import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from openvino_support import one_sequence_batch, requires_openvino, tiny_export_cache  # noqa: F401
from tiny_models import random_prompts

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.backends.openvino import export_cache
from pagedllm.backends.openvino.step_inputs import InvalidBlockTableError
from pagedllm.models.source import cache_dir

pytestmark = [requires_openvino, pytest.mark.usefixtures("tiny_export_cache")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = random_prompts([5, 33, 70], seed=7)


def make_llm(model, **kwargs):
    kwargs.setdefault("kv_cache_space", 0.01)
    kwargs.setdefault("dtype", "float32")
    return LLM(str(model), backend="openvino", max_model_len=256, **kwargs)


def token_ids(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def int8_tokens(tiny_llama):
    return token_ids(make_llm(tiny_llama, quantize_weights="int8"))


@pytest.fixture(scope="module")
def cli_folder(tiny_llama, tmp_path_factory):
    """A folder made by `optimum-cli export openvino` with int8 weights."""
    out = tmp_path_factory.mktemp("cli") / "llama-int8"
    cli = shutil.which("optimum-cli") or pytest.fail("optimum-cli is not on PATH")
    subprocess.run([cli, "export", "openvino", "-m", str(tiny_llama), "--task", "text-generation-with-past",
                    "--weight-format", "int8", str(out)], check=True, capture_output=True)
    return out


def test_second_load_reuses_the_export(tiny_llama, monkeypatch, caplog):
    make_llm(tiny_llama)  # exports, unless an earlier test did
    folder = export_cache.export_dir(tiny_llama, tiny_llama.name, "fp32")
    assert (folder / export_cache.MARKER).is_file()

    def no_export(*args):
        raise AssertionError("exported again")

    monkeypatch.setattr(export_cache, "_export_fp32", no_export)
    logger = logging.getLogger("pagedllm.openvino")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pagedllm.openvino"):
            make_llm(tiny_llama)
    finally:
        logger.removeHandler(caplog.handler)
    assert f"reusing the cached OpenVINO export {folder}" in caplog.text


def test_cache_key_covers_weight_format_and_model_files(tiny_llama, tmp_path):
    fp32 = export_cache.export_dir(tiny_llama, "m", "fp32")
    assert fp32 != export_cache.export_dir(tiny_llama, "m", "int8")
    copy = shutil.copytree(tiny_llama, tmp_path / "copy")
    before = export_cache.export_dir(copy, "m", "fp32")
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert export_cache.export_dir(copy, "m", "fp32") != before


def test_optimum_cli_folder_is_used_as_is(cli_folder, int8_tokens):
    exports = cache_dir() / "openvino"
    exports_before = sorted(os.listdir(exports))
    llm = make_llm(cli_folder)
    assert llm.engine.source.kind == "openvino"
    # optimum-cli's int8 weights are NNCF int8_asym, what --quantize-weights int8 makes: same tokens.
    assert token_ids(llm) == int8_tokens
    assert sorted(os.listdir(exports)) == exports_before  # nothing exported


def test_quantizing_an_export_folder_is_refused(cli_folder):
    with pytest.raises(ConfigError, match="used as is"):
        make_llm(cli_folder, quantize_weights="int8")


def test_quantization_flag_means_nncf_compression(tiny_llama, int8_tokens):
    """--quantization int8 is --quantize-weights int8; int4 is NNCF int4 in groups of 128 (adjusted where 128 does
    not divide); the cpu backend's GGUF formats are refused with what to use."""
    assert token_ids(make_llm(tiny_llama, quantization="int8")) == int8_tokens
    int4 = make_llm(tiny_llama, quantization="int4")
    ir = export_cache.export_dir(tiny_llama, int4.engine.backend.model.name, "int4") / export_cache.MODEL_XML
    assert 'element_type="u4"' in ir.read_text()  # NNCF's 4-bit weights are in the IR
    assert "int4 weights (NNCF)" in int4.engine.backend.describe() and len(token_ids(int4)) == len(PROMPTS)
    with pytest.raises(ConfigError, match="use --quantization int8 or int4"):
        make_llm(tiny_llama, quantization="q4_0")


def test_stateless_export_is_refused(tiny_llama, tmp_path):
    from optimum.exporters.openvino import main_export
    from optimum.intel import OVConfig

    main_export(str(tiny_llama), output=tmp_path / "stateless", task="text-generation-with-past", stateful=False,
                ov_config=OVConfig(dtype="fp32"), local_files_only=True)
    with pytest.raises(ConfigError, match="stateless.*without --disable-stateful"):
        make_llm(tmp_path / "stateless")


def test_vllm_env_vars(tiny_llama, monkeypatch, int8_tokens):
    monkeypatch.setenv("VLLM_OPENVINO_CPU_KV_CACHE_PRECISION", "u8")
    monkeypatch.setenv("VLLM_OPENVINO_KVCACHE_SPACE", "0.02")
    monkeypatch.setenv("VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS", "ON")
    llm = LLM(str(tiny_llama), backend="openvino", dtype="float32", max_model_len=256)
    backend = llm.engine.backend
    assert backend.kv_cache.element_type == "u8" and llm.engine.config.backend_options["quantize_weights"] == "int8"
    assert llm.engine.num_blocks == int(0.02 * 2**30) // backend.kv_cache_bytes_per_block()
    # u8 blocks read from the compiled model: keys [2 heads, 32 + 8 rows, 16], values [2, 32, 16 + 8], 2 layers.
    assert backend.kv_cache_bytes_per_block() == 2 * (2 * 40 * 16 + 2 * 32 * 24)
    assert len(token_ids(llm)) == len(PROMPTS)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 16}, "blocks of 32 tokens; pass --block-size 32"),
    ({"dtype": "bfloat16", "kv_cache_dtype": "fp32"}, "fp32 KV cache needs float32 inference"),
])
def test_bad_settings_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_llm(tiny_llama, **kwargs)


def test_tensor_parallel_maps_to_the_plugins_distribution_over_numa_nodes(tmp_path):
    from test_cpu_binding import fake_sysfs

    from pagedllm.backends.openvino.threads import distribution_properties

    supported = ["MODEL_DISTRIBUTION_POLICY"]
    two_sockets = fake_sysfs(tmp_path / "two")
    assert str(distribution_properties(2, supported, two_sockets)["MODEL_DISTRIBUTION_POLICY"]) == \
        "{<ModelDistributionPolicy.TENSOR_PARALLEL: 0>}"
    assert distribution_properties(1, [], two_sockets) == {}
    with pytest.raises(ConfigError, match="this machine has 2; pass --tensor-parallel-size 2"):
        distribution_properties(4, supported, two_sockets)
    with pytest.raises(ConfigError, match="has no model distribution policy"):
        distribution_properties(2, [], two_sockets)


def test_tensor_parallel_on_one_numa_node_says_why_not(tiny_llama):
    with pytest.raises(ConfigError, match="splits a model across NUMA nodes, one part per node, and this machine "
                                          "has 1; pass --tensor-parallel-size 1"):
        make_llm(tiny_llama, tensor_parallel_size=2)


def test_bad_block_tables_are_refused_before_infer(tiny_llama):
    llm = make_llm(tiny_llama, kv_cache_space=16 * 2 * 2 * 2 * 32 * 16 * 4 / 2**30)  # 16 f32 blocks
    backend = llm.engine.backend
    assert llm.engine.num_blocks == 16
    ids = PROMPTS[2][:40]
    with pytest.raises(InvalidBlockTableError, match="refers to KV block 16, but the cache has blocks 0..15"):
        backend.execute(one_sequence_batch(ids, [39], block_ids=[3, 16]))
    with pytest.raises(InvalidBlockTableError, match="refers to KV block -1"):
        backend.execute(one_sequence_batch(ids, [39], block_ids=[-1, 2]))
    with pytest.raises(InvalidBlockTableError, match="40 tokens of context, which need 2 blocks of 32, but its "
                                                     "block table has only 1"):
        backend.execute(one_sequence_batch(ids, [39], block_ids=[3]))
    # Logits come back only for the rows asked for (the Gather before the LM head), also for none.
    vocab = llm.engine.model_info.vocab_size
    assert np.asarray(backend.execute(one_sequence_batch(ids, [0, 20, 39], block_ids=[3, 5]))).shape == (3, vocab)
    assert np.asarray(backend.execute(one_sequence_batch(ids, [], block_ids=[3, 5]))).shape == (0, vocab)
    assert token_ids(llm) == token_ids(make_llm(tiny_llama))  # nothing was corrupted


def test_kv_cache_blocks_start_on_cache_lines(tiny_llama):
    """numpy alone starts large arrays 16 bytes past a line: the plugin's vector loads would straddle lines."""
    llm = make_llm(tiny_llama, kv_cache_space=0.05)
    buffers = llm.engine.backend.kv_cache.buffers
    assert buffers and all(b.ctypes.data % 64 == 0 and b.shape[1] % 64 == 0 for b in buffers)
    assert token_ids(llm) == token_ids(make_llm(tiny_llama))


def test_pagedllm_backends_lists_openvino_available():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "backends"], check=True,
                         capture_output=True, text=True).stdout
    assert any(line.split()[:1] == ["openvino"] and line.endswith("available") for line in out.splitlines()), out


def test_without_openvino_the_listing_says_what_to_install():
    """The plugin imports without openvino; is_available names the missing package and the install command."""
    script = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'openvino': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from pagedllm.plugins import list_backends\n"
        "print([i.reason for i in list_backends() if i.name == 'openvino'][0])\n")
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert "openvino not installed" in out and "make install" in out and "--no-deps optimum-intel" in out, out


def test_the_first_kv_blocks_are_in_memory_before_the_first_step(tiny_llama, monkeypatch):
    """The blocks the allocator hands out first (the lowest ids) are committed at start-up, up to a budget."""
    from test_memory import all_resident, skip_unless_commit_works

    from pagedllm.backends.common import memory

    skip_unless_commit_works()

    def committed(buffer: np.ndarray, rows: int) -> bool:
        return all_resident(buffer.ctypes.data, rows * buffer.shape[1])

    llm = make_llm(tiny_llama)  # 0.01 GiB: all of it within the budget
    cache, request = llm.engine.backend.kv_cache, llm.engine.backend.request
    assert all(committed(buffer, len(buffer)) for buffer in cache.buffers)
    monkeypatch.setattr(memory, "KV_COMMIT_BYTES", 3 * cache.bytes_per_block())
    assert cache.allocate(llm.engine.num_blocks, request) == 3
    assert all(committed(buffer, 3) for buffer in cache.buffers)
