"""Tensor parallelism on the cpu backend: the ranks' greedy output equals one process's and transformers', token
for token in float32; two "nodes" over 127.0.0.1; a killed rank fails the engine fast, naming it; the refusals."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from equality_support import GREEDY, build_references, token_ids
from tiny_models import kv_bytes_per_block

from pagedllm import LLM, SamplingParams
from pagedllm.backends.cpu.tensor_parallel.executor import TensorParallelError
from pagedllm.engine.arg_utils import from_cli_args
from pagedllm.errors import ConfigError

ARCHS = ["llama", "qwen2"]
LENGTHS = [1, 5, 16, 17, 31, 40, 64, 90, 7]


@pytest.fixture(scope="module")
def references(tiny_model_dirs):
    return build_references(tiny_model_dirs, ARCHS, LENGTHS, prefix_len=50, short_prefix_len=35)


def make_llm(model_dir, **kwargs):
    kwargs.setdefault("kv_cache_space", 0.05)
    return LLM(str(model_dir), dtype="float32", max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_equal_one_and_transformers(tiny_model_dirs, references, arch):
    """Prefix caching, chunked prefill, preemption and (at TP=2) speculative decoding at once: a pool of 20 blocks
    per rank, evictions included."""
    shared, shared_expected = references[arch]["shared"]
    plain, plain_expected = references[arch]["plain"]
    settings = dict(enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=32,
                    max_num_seqs=8)
    one_rank_space = 20 * kv_bytes_per_block(arch) / 2**30
    llms = {1: make_llm(tiny_model_dirs[arch], kv_cache_space=one_rank_space, **settings),
            2: make_llm(tiny_model_dirs[arch], kv_cache_space=one_rank_space / 2, tensor_parallel_size=2,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                        **settings)}  # the space is per rank, and a rank holds half the KV heads; TP=2 speculates
    try:
        for size, llm in llms.items():
            assert llm.engine.num_blocks == 20
            for prompts, expected in [(shared, shared_expected), (plain, plain_expected), (shared, shared_expected)]:
                assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected, f"TP={size}"
            assert llm.engine.scheduler.num_preemptions > 0
            assert llm.engine.kv_manager.prefix_cache.hits > 0
        assert llms[2].engine.stats().spec_draft_tokens > 0
        ranks = llms[2].engine.backend.runner.ranks
        assert [r["kv_heads"] for r in ranks] == [1, 1]  # of the model's 2
    finally:
        llms[2].shutdown()


def test_the_log_shows_each_rank(tiny_llama, pagedllm_logs):
    llm = make_llm(tiny_llama, tensor_parallel_size=2, cpu_omp_threads_bind="0|1")
    processes = list(llm.engine.backend.runner.processes)
    llm.shutdown()
    text = pagedllm_logs.text
    for rank in (0, 1):
        assert f"TP rank {rank} on " in text and f"bound to CPUs {rank} " in text
    assert "weight shard" in text and f"KV cache on each of the 2 TP ranks: {llm.engine.num_blocks} blocks" in text
    assert all(p.returncode == 0 for p in processes)  # shut down cleanly


def test_two_nodes_over_loopback(tiny_model_dirs, references):
    """Node 1 runs its rank with the node command; node 0 runs the engine and rank 0."""
    prompts, expected = references["llama"]["plain"]
    with socket.socket() as s:  # a port nothing listens on yet, for node 0's rendezvous
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    node = subprocess.Popen(
        [sys.executable, "-m", "pagedllm.backends.cpu.tensor_parallel.node", "-tp", "2", "--nnodes", "2",
         "--node-rank", "1", "--distributed-init-method", init], env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "1"})
    try:
        llm = make_llm(tiny_model_dirs["llama"], tensor_parallel_size=2, nnodes=2, node_rank=0,
                       distributed_init_method=init, cpu_omp_threads_bind="0")
        assert len(llm.engine.backend.runner.processes) == 1  # only rank 0 is this node's
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
        llm.shutdown()
        assert node.wait(30) == 0
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_killed_rank_fails_the_engine_naming_it(tiny_llama):
    llm = make_llm(tiny_llama, tensor_parallel_size=2)
    victim = llm.engine.backend.runner.processes[1]
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with pytest.raises(TensorParallelError) as failure:
        for _ in range(100):  # until the kill lands
            llm.generate([[5, 6, 7]] * 8, long, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    message = str(failure.value)
    assert f"TP rank 1 (pid {victim.pid}) was killed by SIGKILL" in message and "out-of-memory" in message
    with pytest.raises(TensorParallelError):  # the engine stays failed
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert victim.poll() is not None and not llm.engine.backend.runner.processes  # rank 0 was stopped too
    llm.shutdown()


def test_a_stopped_rank_fails_the_engine_within_seconds(tiny_llama):
    """SIGSTOP: the rank neither answers nor exits, and its peers would wait in a collective for gloo's timeout."""
    llm = make_llm(tiny_llama, tensor_parallel_size=2)
    victim = llm.engine.backend.runner.processes[1]
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with pytest.raises(TensorParallelError, match=f"TP rank 1 \\(pid {victim.pid}\\) has been stopped"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert time.monotonic() - stopped_at < 10
    assert victim.poll() is not None  # killed with the others
    llm.shutdown()


@pytest.mark.parametrize("settings, message", [
    (dict(tensor_parallel_size=3, cpu_omp_threads_bind="nobind"),
     "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=4, cpu_omp_threads_bind="nobind"),
     "--tensor-parallel-size 4 does not divide the model's 2 KV heads"),
    (dict(tensor_parallel_size=2, cpu_omp_threads_bind="0|1|0"), "names 3 CPU sets but there are 2"),
    (dict(tensor_parallel_size=len(os.sched_getaffinity(0)) + 2), "need a physical core each"),
    (dict(tensor_parallel_size=2, nnodes=2), "needs --distributed-init-method"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=1, distributed_init_method="tcp://127.0.0.1:1"),
     "python -m pagedllm.backends.cpu.tensor_parallel.node"),
])
def test_refusals_say_why(tiny_llama, settings, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        make_llm(tiny_llama, **settings)


def test_the_kv_space_is_checked_for_every_rank_on_this_machine(tiny_llama, monkeypatch):
    """The space is per rank, as in vLLM: two local ranks hold two caches, which must fit together."""
    monkeypatch.setattr("pagedllm.kv.sizing.available_memory_bytes", lambda: 2**30)  # 0.9 GiB usable
    make_llm(tiny_llama, kv_cache_space=0.6).shutdown()  # one cache of 0.6 GiB fits
    with pytest.raises(ConfigError, match=r"more than the 0\.45 GiB of memory available for each of the 2 "
                                          r"tensor-parallel ranks on this machine"):
        make_llm(tiny_llama, kv_cache_space=0.6, tensor_parallel_size=2)


def test_the_node_command_refuses_node_0():
    proc = subprocess.run([sys.executable, "-m", "pagedllm.backends.cpu.tensor_parallel.node", "-tp", "2",
                           "--nnodes", "2", "--node-rank", "0", "--distributed-init-method", "tcp://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "node 0 runs the engine" in proc.stderr


def test_cli_flag_and_env_var(monkeypatch):
    from pagedllm.backends.cpu.backend import CPUBackend
    from pagedllm.config import EngineArgs, resolve
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "-tp", "2"])
    assert from_cli_args(args).backend_options["tensor_parallel_size"] == 2
    monkeypatch.setenv("PAGEDLLM_TENSOR_PARALLEL_SIZE", "4")
    assert resolve(EngineArgs(), backend_settings=CPUBackend.settings).backend_options["tensor_parallel_size"] == 4


@pytest.fixture(scope="module")
def smollm2():
    from pagedllm.models.source import resolve_model

    return resolve_model(None)


def test_smollm2_heads_do_not_split_in_two(smollm2):
    with pytest.raises(ConfigError, match="does not divide the model's 9 attention heads.*use one of 1, 3, 9"):
        LLM(dtype="float32", max_model_len=256, kv_cache_space=0.1, tensor_parallel_size=2)


def test_smollm2_three_ranks_equal_transformers(smollm2):
    """SmolLM2-135M has 9 heads and 3 KV heads: three ranks, unpinned (this box has two cores), with prefix
    caching, chunked prefill and preemption on."""
    import torch
    from transformers import AutoModelForCausalLM

    new_tokens = 16
    block_bytes = 2 * 30 * 1 * 16 * 64 * 4  # layers x (3 KV heads / 3 ranks) x block x head size x float32, K and V
    llm = LLM(dtype="float32", max_model_len=96, kv_cache_space=6 * block_bytes / 2**30, tensor_parallel_size=3,
              cpu_omp_threads_bind="nobind", enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8)
    try:
        assert llm.engine.num_blocks == 6  # one 96-token sequence fits, the three prompts together do not
        questions = ["Tell me about Paris", "Write a haiku about the sea.", "Why is the sky blue?"]
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}])["prompt_token_ids"] for q in questions]
        ref = AutoModelForCausalLM.from_pretrained(smollm2.hf_dir, dtype=torch.float32)
        expected = []
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                y = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=2, eos_token_id=None)
                expected.append(y[0, len(ids):].tolist())
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert llm.engine.kv_manager.prefix_cache.hits > 0  # the chat prompts share the system prompt
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


def test_a_rank_reads_a_gguf_file_a_layer_and_its_vocabulary_rows_at_a_time(smollm2):
    """SmolLM2's GGUF at two ranks: each decoder layer is sharded as soon as its tensors are read (a rank never holds
    every layer whole), its shares are copies (a view would keep the whole weight alive), the tied head is read as
    this rank's half of the vocabulary alone, and the token embedding looks that half up in it: the rows the whole
    table has, and no dense table."""
    import torch

    from pagedllm.backends.cpu.layers.packed_linear import use_packed_linears
    from pagedllm.backends.cpu.layers.quantized_embedding import embed_from_head
    from pagedllm.backends.cpu.layers.quantized_linear import quantized_weight
    from pagedllm.backends.cpu.runner.gguf_loading import load_gguf_model
    from pagedllm.backends.cpu.runner.kernels import load_kernels
    from pagedllm.backends.cpu.runner.sharding import Rank, RowParallel, VocabParallelEmbedding, VocabParallelHead

    whole, _ = load_gguf_model(str(smollm2.config_dir), smollm2.path, torch.float32, "sdpa")
    model, weights = load_gguf_model(str(smollm2.config_dir), smollm2.path, torch.float32, "sdpa",
                                     embedding_from_head=True, rank=Rank(1, 2))
    head, full_head = model.get_output_embeddings(), quantized_weight(whole.get_output_embeddings())
    share = quantized_weight(head.linear)
    assert isinstance(head, VocabParallelHead) and torch.equal(share.values, full_head.values[24576:49152])
    assert share.values.untyped_storage().nbytes() == share.values.nbytes
    embedding = model.get_decoder().embed_tokens
    assert isinstance(embedding, VocabParallelEmbedding) and (embedding.start, embedding.end) == (24576, 49152)
    assert embedding.lookup.weight.is_meta  # left for the head's slice
    for layer, full in zip(model.get_decoder().layers, whole.get_decoder().layers):
        assert isinstance(layer.self_attn.o_proj, RowParallel) and isinstance(layer.mlp.down_proj, RowParallel)
        share, gate = quantized_weight(layer.mlp.gate_proj), quantized_weight(full.mlp.gate_proj)
        assert share.values.shape[0] * 2 == gate.values.shape[0]
        assert torch.equal(share.values, gate.values[gate.values.shape[0] // 2:])
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in (share.values, share.scales, share.offsets))
    assert weights["model.layers.0.self_attn.o_proj.linear"] is quantized_weight(
        model.get_decoder().layers[0].self_attn.o_proj.linear)  # the log counts the shares
    assert weights["lm_head.linear"] is quantized_weight(head.linear)
    kernels, _ = load_kernels("auto")
    if kernels is not None:
        use_packed_linears(model, kernels)
        assert embed_from_head(model, kernels)
        ids = torch.tensor([0, 5, 12345, 24575])  # local rows 0..24575 of the slice: tokens 24576..49151
        assert torch.equal(embedding.lookup(ids), whole.get_input_embeddings().weight[ids + 24576])


def test_a_rank_quantizes_at_load_a_layer_at_a_time_and_only_its_rows_of_the_head(tiny_llama):
    """--quantization at two ranks, over the memory-mapped files: each decoder layer is sharded as soon as it is
    quantized (the shares are the whole quantization's halves, in storage of their own), the LM head is quantized in
    this rank's vocabulary rows only, and the embedding's rows stay a view of the file (resident where read)."""
    import torch

    from pagedllm.backends.common.memory import checkpoint_mappings, in_mappings
    from pagedllm.backends.cpu.layers.quantized_linear import quantized_weight
    from pagedllm.backends.cpu.runner.quantization import quantize_linears
    from pagedllm.backends.cpu.runner.shard_loading import meta_model_over_files
    from pagedllm.backends.cpu.runner.sharding import Rank, RowParallel, VocabParallelHead, shard_model, vocab_slice

    whole = meta_model_over_files(str(tiny_llama), torch.float32, "sdpa")
    quantize_linears(whole, "q8_0", torch.float32)
    model = meta_model_over_files(str(tiny_llama), torch.float32, "sdpa")
    weights = quantize_linears(model, "q8_0", torch.float32, Rank(1, 2))
    for layer, full in zip(model.get_decoder().layers, whole.get_decoder().layers):
        assert isinstance(layer.self_attn.o_proj, RowParallel) and isinstance(layer.mlp.down_proj, RowParallel)
        share, gate = quantized_weight(layer.mlp.gate_proj), quantized_weight(full.mlp.gate_proj)
        assert torch.equal(share.values, gate.values[gate.values.shape[0] // 2:])
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in (share.values, share.scales, share.offsets))
    head, vocab = model.get_output_embeddings(), whole.get_output_embeddings().out_features
    start, end, _ = vocab_slice(vocab, Rank(1, 2))
    assert isinstance(head, VocabParallelHead) and weights["lm_head.linear"] is quantized_weight(head.linear)
    rows = quantized_weight(head.linear).values[:end - start]
    assert torch.equal(rows, quantized_weight(whole.get_output_embeddings()).values[start:end])
    shard_model(model, Rank(1, 2))
    assert in_mappings(model.get_decoder().embed_tokens.lookup.weight, checkpoint_mappings())


def test_a_rank_keeps_its_dense_vocabulary_rows_as_views_of_the_file(tiny_llama):
    """A dense rank's slices of the embedding and of the LM head stay views of the memory-mapped file (packing copies
    the head's); the rows are the file's."""
    import torch

    from pagedllm.backends.common.memory import checkpoint_mappings, in_mappings
    from pagedllm.backends.cpu.runner.shard_loading import meta_model_over_files
    from pagedllm.backends.cpu.runner.sharding import Rank, shard_model, vocab_slice

    model = meta_model_over_files(str(tiny_llama), torch.float32, "sdpa")
    table = model.get_output_embeddings().weight.detach().clone()
    shard_model(model, Rank(0, 2))  # rank 0's slice is never padded
    _, end, _ = vocab_slice(table.shape[0], Rank(0, 2))
    head, embedding = model.get_output_embeddings().linear.weight, model.get_decoder().embed_tokens.lookup.weight
    assert in_mappings(head, checkpoint_mappings()) and in_mappings(embedding, checkpoint_mappings())
    assert torch.equal(head, table[:end])


def test_ranks_on_one_machine_meet_through_a_file_and_loopback():
    """No port is opened for the rendezvous of local ranks, and their gloo links stay on loopback."""
    from pagedllm.backends.cpu.tensor_parallel.launch import local_init_method, rank_env, remove_local_rendezvous

    init = local_init_method()
    assert init.startswith("file://") and rank_env(init)["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in rank_env("tcp://10.0.0.1:29500") or os.environ.get("GLOO_SOCKET_IFNAME")
    folder = Path(init.removeprefix("file://")).parent
    assert folder.is_dir()
    remove_local_rendezvous(init)
    assert not folder.exists()
