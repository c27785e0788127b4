"""``LLM(engine_process=True)``: the scheduler and the model in an engine-core process, text and stop strings made
in this one. Outputs equal the in-process engine's, token for token and character for character; a stop string
ends the sequence in the core at once; refusals and the core's death reach the caller."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

import pytest

from pagedllm import LLM, InvalidRequestError, SamplingParams

PROMPTS = ["Paris is the capital of", "The quick brown fox", "A paged KV cache"]


@pytest.fixture(scope="module")
def llms(tiny_llama):
    settings = dict(dtype="float32", max_model_len=256, kv_cache_space=0.01)
    local, split = LLM(str(tiny_llama), **settings), LLM(str(tiny_llama), engine_process=True, **settings)
    yield local, split
    split.shutdown()


def fields(outputs):
    return [(o.prompt_logprobs, o.num_cached_tokens,
             [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
              for c in o.outputs]) for o in outputs]


def greedy_texts(llm, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_and_sampled_outputs_equal_the_in_process_engine(llms):
    local, split = llms
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=3, n=3, max_tokens=16, ignore_eos=True, logprobs=2,
                                  prompt_logprobs=1),
                   SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[5, 7, 11])):
        assert fields(split.generate(PROMPTS, params, use_tqdm=False)) == \
            fields(local.generate(PROMPTS, params, use_tqdm=False)), params


@pytest.mark.parametrize("include, min_tokens", [(False, 0), (True, 0), (False, 6)])
def test_stop_strings_end_text_where_the_in_process_engine_does(llms, include, min_tokens):
    local, split = llms
    texts = greedy_texts(local)
    # a stop string per prompt, from its greedy text: early (so min_tokens matters) and a few characters long
    for prompt, text in zip(PROMPTS, texts):
        stop = text.strip()[1:4]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "never there"],
                                include_stop_str_in_output=include, min_tokens=min_tokens)
        expected = local.generate(prompt, params, use_tqdm=False)
        assert fields(split.generate(prompt, params, use_tqdm=False)) == fields(expected)
        assert expected[0].finish_reason == "stop" or min_tokens  # past min_tokens the string may not come again


def test_stop_strings_in_some_of_n_sampled_sequences(llms):
    local, split = llms
    sampled = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=20, ignore_eos=True)
    texts = [c.text for c in local.generate(PROMPTS[0], sampled, use_tqdm=False)[0].outputs]
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=20, ignore_eos=True, stop=[texts[1][2:4]])
    expected = local.generate(PROMPTS[0], params, use_tqdm=False)
    assert fields(split.generate(PROMPTS[0], params, use_tqdm=False)) == fields(expected)
    assert {c.finish_reason for c in expected[0].outputs} == {"stop", "length"} or \
        all(c.finish_reason == "stop" for c in expected[0].outputs)


def test_a_stop_string_stops_generation_in_the_core(llms):
    local, split = llms
    text = greedy_texts(local, max_tokens=8)[0]
    before = split.engine.stats().generation_tokens
    out = split.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True,
                                                     stop=[text.strip()[:3]]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 8
    split.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)  # a later step: its stats follow the stop
    stats = split.engine.stats()
    assert stats.generation_tokens - before < 20 and stats.num_running == 0 and stats.kv_blocks_used == 0


def test_a_refused_request_raises_and_the_core_keeps_serving(llms):
    local, split = llms
    with pytest.raises(InvalidRequestError, match="more than max_model_len 256") as info:
        split.generate([[5] * 300, PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert info.value.param == "prompt"
    assert greedy_texts(split) == greedy_texts(local)


def test_the_generate_command_streams_through_a_core_process_and_freezes_its_heap(tiny_llama):
    """The command's process lives as long as its engine, so it freezes what start-up made (its exit then skips
    collecting it), as the server does."""
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model", str(tiny_llama), "--dtype", "float32",
         "--max-model-len", "64", "--kv-cache-space", "0.01", "--max-tokens", "5", "--no-chat", "--engine-process",
         "Paris"], capture_output=True, text=True, timeout=300, env={**os.environ, "PAGEDLLM_LOGGING_LEVEL": "DEBUG"})
    assert proc.returncode == 0, proc.stderr
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, kv_cache_space=0.01)
    expected = llm.generate("Paris", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].text
    assert proc.stdout == expected + "\n"
    assert proc.stderr.count("start-up heap frozen") == 2  # the engine core's, and the command's own


def test_the_core_dying_is_an_error_not_a_hang(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, kv_cache_space=0.01, engine_process=True)
    os.kill(llm.engine.core.proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"exited unexpectedly \(exit code -9\)"):
        llm.generate("Paris", SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    llm.shutdown()


def test_a_request_id_can_be_reused_right_after_its_abort(llms):
    """What the core sent for the aborted request before the abort reached it never reaches the new one."""
    local, split = llms
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [expected] = local.generate(PROMPTS[1], params, use_tqdm=False)
    engine = split.engine
    engine.add_request("again", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()
    engine.abort_request("again")
    engine.add_request("again", PROMPTS[1], params)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals["again"].outputs[0].token_ids == expected.outputs[0].token_ids


def test_only_processes_pagedllm_owns_freeze_their_startup_heap(llms):
    """freeze_startup_heap collects the garbage before it freezes the rest (that the server and its core call it:
    test_engine_process_server.py; the generate command: above); an engine in the caller's process leaves its heap
    alone (what is frozen is never freed)."""
    assert gc.get_freeze_count() == 0  # this process holds an in-process engine, and started a core process
    code = ("import gc, weakref\n"
            "from pagedllm.utils import freeze_startup_heap\n"
            "class Node: pass\n"
            "cycle = Node(); cycle.self = cycle; dropped = weakref.ref(cycle); del cycle\n"
            "freeze_startup_heap()\n"
            "print(dropped() is None, gc.get_freeze_count() > 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "True"], result.stderr
