import argparse

import pytest

from pagedllm.config import EngineArgs, resolve, resolve_backend_name
from pagedllm.engine.arg_utils import add_cli_args, from_cli_args
from pagedllm.errors import ConfigError

CPU_ENV = {"kv_cache_space": ("PAGEDLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")}


def test_defaults():
    c = resolve(EngineArgs(), CPU_ENV, environ={})
    assert (c.backend, c.dtype, c.max_num_seqs, c.kv_cache_space, c.seed) == ("cpu", "auto", 256, 4.0, 0)
    assert c.enable_chunked_prefill and c.enable_prefix_caching  # both on by default, as in vLLM
    assert c.sources["kv_cache_space"] == "default"


def test_flag_beats_env_beats_default():
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "PAGEDLLM_MAX_NUM_SEQS": "8", "PAGEDLLM_ENABLE_PREFIX_CACHING": "off"}
    c = resolve(EngineArgs(max_num_seqs=3), CPU_ENV, environ=env)
    assert c.kv_cache_space == 2.0 and c.sources["kv_cache_space"] == "VLLM_CPU_KVCACHE_SPACE"
    assert c.max_num_seqs == 3 and c.sources["max_num_seqs"] == "flag"
    assert c.enable_prefix_caching is False
    c = resolve(EngineArgs(kv_cache_space=1.5), CPU_ENV, environ=env)
    assert c.kv_cache_space == 1.5


def test_pagedllm_name_beats_the_vllm_name():
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "PAGEDLLM_CPU_KVCACHE_SPACE": "3"}
    assert resolve(EngineArgs(), CPU_ENV, environ=env).kv_cache_space == 3.0


def test_backend_resolution():
    assert resolve_backend_name(EngineArgs(), environ={}) == "cpu"
    assert resolve_backend_name(EngineArgs(), environ={"PAGEDLLM_BACKEND": "openvino"}) == "openvino"
    assert resolve_backend_name(EngineArgs(backend="cpu"), environ={"PAGEDLLM_BACKEND": "openvino"}) == "cpu"


@pytest.mark.parametrize("env, message", [
    ({"VLLM_CPU_KVCACHE_SPACE": "lots"}, "VLLM_CPU_KVCACHE_SPACE='lots' is not a valid float"),
    ({"VLLM_CPU_KVCACHE_SPACE": "0"}, "more than 0 GiB"),
    ({"PAGEDLLM_ENABLE_CHUNKED_PREFILL": "maybe"}, "PAGEDLLM_ENABLE_CHUNKED_PREFILL"),
    ({"PAGEDLLM_DTYPE": "int4"}, "dtype 'int4' is not one of"),
    ({"PAGEDLLM_MAX_NUM_SEQS": "0"}, "max_num_seqs must be a positive integer"),
])
def test_bad_env_values_name_the_variable(env, message):
    with pytest.raises(ConfigError, match=message):
        resolve(EngineArgs(), CPU_ENV, environ=env)


def test_budget_below_max_model_len_without_chunking_says_what_to_change():
    c = resolve(EngineArgs(max_num_batched_tokens=512, max_num_seqs=4, enable_chunked_prefill=False), environ={})
    with pytest.raises(ConfigError, match="--enable-chunked-prefill"):
        c.finalize(model_max_len=2048, default_block_size=16)


def test_budget_below_max_num_seqs_is_refused():
    c = resolve(EngineArgs(max_num_batched_tokens=16, enable_chunked_prefill=True), environ={})
    with pytest.raises(ConfigError, match="max_num_seqs"):
        c.finalize(model_max_len=2048, default_block_size=16)


def test_max_model_len_above_the_model_is_refused():
    c = resolve(EngineArgs(max_model_len=4096), environ={})
    with pytest.raises(ConfigError, match="longer than the model allows"):
        c.finalize(model_max_len=2048, default_block_size=16)


def test_finalize_fills_model_dependent_defaults():
    c = resolve(EngineArgs(enable_chunked_prefill=False), environ={})
    c.finalize(model_max_len=8192, default_block_size=32)
    assert (c.max_model_len, c.block_size, c.max_num_batched_tokens) == (8192, 32, 8192)
    c = resolve(EngineArgs(), environ={})
    c.finalize(model_max_len=8192, default_block_size=16)
    assert c.max_num_batched_tokens == 2048


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--max-num-seqs", "4", "--enable-prefix-caching", "--no-enable-chunked-prefill",
                            "--kv-cache-space", "0.5", "--dtype", "float32"])
    args = from_cli_args(ns)
    assert (args.max_num_seqs, args.enable_prefix_caching, args.enable_chunked_prefill) == (4, True, False)
    assert (args.kv_cache_space, args.dtype, args.model) == (0.5, "float32", None)
