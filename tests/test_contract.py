"""The seams: the backend contract imports nothing of the engine, backends own their settings, one stats snapshot."""

import argparse
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, resolve
from pagedllm.engine.arg_utils import add_cli_args, from_cli_args, settings_table
from pagedllm.engine.stats import EngineStats, StatsLogger
from pagedllm.errors import ConfigError
from pagedllm.utils import module_command

SETTINGS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_the_contract_imports_neither_the_engine_nor_transformers():
    code = ("import sys; import pagedllm.backend, pagedllm.batch, pagedllm.errors; "
            "print(sorted(m for m in sys.modules if m in ('pagedllm.engine.llm_engine', 'pagedllm.sched.scheduler', "
            "'pagedllm.engine.llm', 'transformers', 'torch')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_package_face_still_offers_every_name():
    import pagedllm

    assert pagedllm.LLM is LLM and pagedllm.SamplingParams is SamplingParams
    with pytest.raises(AttributeError):
        pagedllm.NoSuchThing  # noqa: B018


def test_unknown_keywords_of_llm_become_backend_options():
    args = EngineArgs.from_kwargs(model="m", dtype="float32", quantize_weights="int8")
    assert (args.model, args.dtype, args.backend_options) == ("m", "float32", {"quantize_weights": "int8"})


def test_a_backend_setting_resolves_flag_then_vllm_env_then_default():
    from pagedllm.backends.openvino.backend import OpenVINOBackend

    def options(args, environ):
        return resolve(args, backend_settings=OpenVINOBackend.settings, environ=environ).backend_options

    assert options(EngineArgs(), {}) == {"quantization": "auto", "quantize_weights": "none",
                                         "cpu_omp_threads_bind": "auto", "tensor_parallel_size": 1}
    env = {"VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS": "ON", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert options(EngineArgs(), env) == {"quantization": "auto", "quantize_weights": "int8",
                                          "cpu_omp_threads_bind": "0-1", "tensor_parallel_size": 1}
    flag = EngineArgs(backend_options={"quantize_weights": "none"})
    assert options(flag, env)["quantize_weights"] == "none"
    with pytest.raises(ConfigError, match="VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS: quantize_weights 'int4'"):
        options(EngineArgs(), {"VLLM_OPENVINO_ENABLE_QUANTIZED_WEIGHTS": "int4"})


def test_a_setting_of_no_backend_is_refused():
    with pytest.raises(ConfigError, match="unknown engine setting 'no_such_knob'"):
        resolve(EngineArgs(backend_options={"no_such_knob": 1}), environ={})


def test_the_cli_takes_the_backends_flags():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--quantize-weights", "int8", "--cpu-omp-threads-bind", "0"])
    assert from_cli_args(ns).backend_options == {"quantize_weights": "int8", "cpu_omp_threads_bind": "0"}
    assert "(openvino backend)" in parser.format_help() and "(cpu/openvino backend)" in parser.format_help()


def test_the_settings_page_carries_the_generated_table():
    """`pagedllm backends --help-settings` prints it; docs/settings.md must carry it unchanged."""
    table = "\n".join(settings_table())
    assert table in SETTINGS_PAGE.read_text(), \
        "paste the output of `pagedllm backends --help-settings` into docs/settings.md"
    for flag in ("--kv-cache-space", "--quantize-weights", "--cpu-omp-threads-bind", "VLLM_CPU_OMP_THREADS_BIND"):
        assert flag in table


def test_stats_are_one_snapshot(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01, enable_prefix_caching=True)
    assert llm.engine.stats() == EngineStats(kv_blocks_total=llm.engine.num_blocks, prefix_caching=True)
    llm.generate([list(range(5, 22))] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.prompt_tokens, stats.generation_tokens, stats.finished_requests) == (34, 8, 2)
    assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
    assert stats.prefix_cache_queries == 34 and stats.prefix_cache_hits == 16  # the second sees the first's block
    assert stats.peak_kv_blocks >= 2 and stats.steps >= 4
    with pytest.raises(AttributeError):
        stats.steps = 0
    llm.shutdown()


def test_the_stats_log_line_comes_every_interval_while_busy(caplog):
    log = StatsLogger(logging.getLogger("stats-test"), interval=10)
    caplog.set_level(logging.INFO, logger="stats-test")
    log.observe(EngineStats(steps=1), now=0)
    log.observe(EngineStats(steps=5, prompt_tokens=100, generation_tokens=20, num_running=3, kv_blocks_total=10,
                            kv_blocks_used=4), now=5)
    assert not caplog.records  # not yet
    log.observe(EngineStats(steps=9, prompt_tokens=200, generation_tokens=40, num_running=3, kv_blocks_total=10,
                            kv_blocks_used=4), now=10)
    assert caplog.messages == ["20.0 prompt tok/s, 4.0 generation tok/s; running 3, waiting 0; KV cache 40.0% used; "
                               "0 preemptions"]
    log.observe(EngineStats(steps=9), now=30)  # idle: no line
    assert len(caplog.records) == 1


def test_child_processes_do_not_import_from_the_working_directory(tmp_path):
    """The engine core and tensor-parallel ranks start through module_command: a file in the working directory
    named like a module they import is not run in its place."""
    (tmp_path / "platform.py").write_text("raise SystemExit('shadowed by the working directory')")
    proc = subprocess.run(module_command("platform"), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "shadowed" not in proc.stdout + proc.stderr
