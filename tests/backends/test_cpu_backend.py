"""cpu backend settings: dtype choice, KV cache dtypes, logs of what was chosen."""

import json
import os
import platform
import statistics
import subprocess
import sys

import pytest
import torch
from tiny_models import kv_bytes_per_block
from transformers import AutoConfig

from pagedllm import LLM, ConfigError, SamplingParams
from pagedllm.backends.common import cpu_features
from pagedllm.backends.common.cpu_binding import process_cpus
from pagedllm.backends.common.memory import tcmalloc_loaded
from pagedllm.backends.cpu.backend import choose_dtype, choose_kv_cache
from pagedllm.backends.cpu.runner.allocator import tcmalloc_status
from pagedllm.backends.cpu.runner.kernels import load_kernels


def test_dtype_choice():
    assert choose_dtype("auto", native_bf16=True)[0] == torch.bfloat16
    assert choose_dtype("auto", native_bf16=False)[0] == torch.float32
    dtype, why = choose_dtype("float16", native_bf16=True)
    assert dtype == torch.bfloat16 and "runs it as bfloat16" in why
    assert choose_dtype("float32", native_bf16=True)[0] == torch.float32


pytestmark = pytest.mark.cpu_isa  # dtype auto and the kernel path follow the CPU


def test_dtype_auto_follows_the_isa_level_in_use(tiny_llama):
    llm = LLM(str(tiny_llama), kv_cache_space=0.01, max_model_len=128)
    expected = "bfloat16" if cpu_features.has_native_bf16() else "float32"
    assert llm.engine.model_info.dtype == expected
    llm.shutdown()


def test_kv_cache_choice():
    assert choose_kv_cache("auto", torch.float32)[:2] == ("plain", torch.float32)
    assert choose_kv_cache("bf16", torch.float32)[:2] == ("plain", torch.bfloat16)
    kind, dtype, why = choose_kv_cache("fp16", torch.float32)
    assert dtype == torch.bfloat16 and "run as bfloat16" in why
    assert choose_kv_cache("u8", torch.bfloat16)[0] == "u8"


def test_tcmalloc_status_says_what_to_do():
    status = tcmalloc_status()
    assert "preloaded" in status or "LD_PRELOAD=" in status


_ALLOCATIONS = """
import ctypes, json, resource, sys, torch
from pagedllm.backends.cpu.runner.allocator import keep_freed_memory
if sys.argv[1] == "tuned":
    print(keep_freed_memory(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
heap_start = next(int(line.split("-")[0], 16) for line in open("/proc/self/maps") if "[heap]" in line)
big = torch.ones(5 << 20)  # 20 MiB
in_heap = heap_start <= big.data_ptr() < libc.sbrk(0)
faults = []
for _ in range(8):  # a step's worth of tensors of 1-12 MiB, every page written, freed again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(n << 18) for n in (12, 2, 6, 2, 12, 4, 12, 1, 6, 12)]
    top = libc.sbrk(0)
    del tensors
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"in_heap": in_heap, "heap_kept": libc.sbrk(0) == top, "faults": faults}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or tcmalloc_loaded(), reason="tunes glibc's malloc")
def test_freed_memory_stays_in_the_process():
    """Tensors of a few MiB are allocated and freed by the dozen every step: once tuned, they come from the heap
    and the heap is not trimmed, so later steps reuse the pages instead of faulting them in afresh (untuned,
    glibc hands them back, and half of the runs here fault ~14,000 pages every round)."""
    def allocations(mode):
        done = subprocess.run([sys.executable, "-c", _ALLOCATIONS, mode], capture_output=True, text=True, check=True)
        return done.stderr, json.loads(done.stdout)

    _, untuned = allocations("untuned")
    log, tuned = allocations("tuned")
    assert "keeping freed memory" in log
    assert not untuned["in_heap"] and tuned["in_heap"]  # glibc's default: above 128 KiB, mmap
    assert tuned["heap_kept"]
    # the heap grows over the first rounds while its free blocks settle into a reusable layout (up to 11,000
    # further pages in round 2 or 3, varying run to run); from then on a round reuses them, bar a stray round that
    # still grows it, so the median of the later rounds is what is bounded
    assert statistics.median(tuned["faults"][3:]) < 1024, tuned  # each round writes 17,700 pages


_LOADING = """
import ctypes, sys, torch
from pagedllm.backends.cpu.runner.allocator import free_loading_buffers_at_once
if sys.argv[1] == "loading":
    free_loading_buffers_at_once()
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
heap_start = next(int(line.split("-")[0], 16) for line in open("/proc/self/maps") if "[heap]" in line)
big = torch.ones(5 << 20)  # a 20 MiB buffer, freed: glibc's own threshold rises to it
del big
shard = torch.ones(6 << 18)  # 6 MiB
print(heap_start <= shard.data_ptr() < libc.sbrk(0))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or tcmalloc_loaded(), reason="tunes glibc's malloc")
def test_loading_buffers_are_mapped_apart_and_go_back_when_freed():
    """While weights load, a buffer of a few MiB after a larger one was freed is mapped apart (returned to the kernel
    when freed), not taken from the heap, where freed shards and temporaries would pile up beside what is made of
    them: a TP rank's peak on the 1B shape was 15% higher so."""
    def in_heap(mode):
        return subprocess.run([sys.executable, "-c", _LOADING, mode], capture_output=True, text=True,
                              check=True).stdout.strip() == "True"

    assert in_heap("untuned") and not in_heap("loading")


def test_logs_say_what_was_chosen(tiny_llama, pagedllm_logs):
    LLM(str(tiny_llama), dtype="float16", kv_cache_space=0.01, max_model_len=128, cpu_omp_threads_bind="auto")
    text = pagedllm_logs.text
    assert "float16 asked: the cpu backend runs it as bfloat16" in text
    assert "threads bound to CPUs" in text and "NUMA node" in text
    assert "TCMalloc" in text and "IPEX" in text
    assert "KV cache:" in text and "blocks of 16 tokens" in text
    assert "weights on " in text and "pages" in text  # the huge-pages step ran at load and said what it chose


@pytest.mark.skipif(load_kernels("auto")[0] is None, reason="the C++ kernels could not be built here")
def test_float32_llama_runs_the_fused_kernels(tiny_llama, pagedllm_logs):
    LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01, max_model_len=128)
    layers = AutoConfig.from_pretrained(tiny_llama).num_hidden_layers
    # Each decoder layer is fused whole (its norms, MLP and RoPE inside); only the final norm is swapped alone.
    assert f"{layers} decoder layers fused" in pagedllm_logs.text
    assert "C++ kernels in the other layers: 1 RMSNorm layers, 0 SwiGLU MLPs, 0 attention layers' RoPE" in \
        pagedllm_logs.text


@pytest.mark.skipif(len(process_cpus()) < 2, reason="needs two CPUs")
def test_the_calling_thread_is_pinned_only_while_the_model_runs(tiny_llama):
    before = os.sched_getaffinity(0)
    cpus = sorted(process_cpus())[:2]
    llm = LLM(str(tiny_llama), kv_cache_space=0.01, max_model_len=128, cpu_omp_threads_bind=f"{cpus[0]},{cpus[1]}")
    during = []
    llm.engine.backend.runner.model.register_forward_pre_hook(lambda *_: during.append(os.sched_getaffinity(0)))
    llm.generate(["a prompt", "another one"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert during and all(cpu_set == {cpus[0]} for cpu_set in during)
    assert os.sched_getaffinity(0) == before  # the user's thread is not left on one CPU
    llm.engine.add_request(None, "a third", SamplingParams(max_tokens=3))
    llm.engine.step()
    assert os.sched_getaffinity(0) == {cpus[0]}  # stepping by hand keeps the pin between steps ...
    llm.shutdown()
    assert os.sched_getaffinity(0) == before  # ... until shutdown


@pytest.mark.parametrize("kv_dtype", ["bf16", "u8"])
def test_the_first_kv_blocks_are_in_memory_before_the_first_step(tiny_llama, kv_dtype, monkeypatch):
    """The blocks the allocator hands out first (the lowest ids) are committed at start-up, up to a budget."""
    from test_memory import all_resident, skip_unless_commit_works

    from pagedllm.backends.common import memory
    from pagedllm.backends.cpu.layers.kv_cache import block_tensors

    skip_unless_commit_works()

    def committed(tensor: torch.Tensor, blocks: int) -> bool:
        return all_resident(tensor.data_ptr(), blocks * tensor.stride(0) * tensor.element_size())

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_space=0.01, max_model_len=128)
    runner = llm.engine.backend.runner
    # 0.01 GiB: all of it within the budget
    assert all(committed(t, llm.engine.num_blocks) for t in block_tensors(runner.kv_caches))
    block_size = llm.engine.config.block_size
    monkeypatch.setattr(memory, "KV_COMMIT_BYTES", 3 * runner.kv_cache_bytes_per_block(block_size))
    runner.allocate_kv_cache(llm.engine.num_blocks, block_size)
    assert all(committed(t, 3) for t in block_tensors(runner.kv_caches))


@pytest.mark.parametrize("kv_dtype, element", [("fp32", 4), ("bf16", 2)])
def test_kv_cache_dtype_sets_the_block_cost(tiny_llama, kv_dtype, element):
    space = 40 * kv_bytes_per_block("llama", element_size=element) / 2**30  # the default block size
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_space=space, max_model_len=128)
    assert llm.engine.num_blocks == 40
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 8


def test_u8_kv_cache_on_a_tiny_model_mostly_agrees(tiny_llama):
    """Greedy with a u8 cache stays close to float32 on the tiny model (SmolLM2 figures: test_cpu_precision)."""
    prompts = [[5 + i, 9, 33, 71, 100 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01,
                                    max_model_len=128).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype="u8", kv_cache_space=0.01, max_model_len=128)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    assert same >= 0.5 * 16 * len(prompts)


def test_the_tensor_parallel_binding_is_refused_clearly(tiny_llama):
    with pytest.raises(ConfigError, match="tensor-parallel ranks"):
        LLM(str(tiny_llama), cpu_omp_threads_bind="0|1", kv_cache_space=0.01, max_model_len=128)


def test_weight_compression_is_refused_by_the_cpu_backend(tiny_llama):
    with pytest.raises(ConfigError, match="--quantize-weights is a setting of the openvino backend, not of 'cpu'"):
        LLM(str(tiny_llama), quantize_weights="int8", kv_cache_space=0.01, max_model_len=128)


def test_an_unsupported_architecture_is_named(tmp_path):
    import transformers

    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    from tiny_models import build_tokenizer

    build_tokenizer(tmp_path)
    from pagedllm import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"model_type 'falcon' \(FalconForCausalLM\); supported: gemma,"):
        LLM(str(tmp_path), kv_cache_space=0.01)


def test_loading_and_quantizing_leave_the_model_files_as_they_were(tiny_llama, tmp_path, monkeypatch):
    """Model files are only read: a load, with quantization at load, changes no byte, size or time of them."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))

    def files():
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in tiny_llama.iterdir()
                if p.is_file()}

    before = files()
    for quantization in (None, "int8"):
        llm = LLM(str(tiny_llama), quantization=quantization, kv_cache_space=0.01, max_model_len=128)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        llm.shutdown()
    assert files() == before
