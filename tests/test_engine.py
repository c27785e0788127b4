"""The engine and the LLM API on a tiny model: bad input, streaming, stops, chat, abort."""

import importlib.util
import subprocess
import sys

import pytest

from pagedllm import LLM, BackendNotFoundError, ConfigError, InvalidRequestError, ModelNotFoundError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01)


def run(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_bad_requests_are_refused_and_others_keep_running(llm):
    engine = llm.engine
    engine.add_request("good-1", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="the prompt has 200 tokens, more than max_model_len 128") as e:
        engine.add_request("long", [5] * 200, SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 384\)"):
        engine.add_request("oov", [5, 999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good-1", [5], SamplingParams())
    engine.add_request("good-2", "Paris is", SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = run(engine)
    assert sorted(outputs) == ["good-1", "good-2"]
    assert len(outputs["good-1"][-1].token_ids) == 4 and outputs["good-1"][-1].finish_reason == "length"
    assert engine.kv_manager.allocator.num_used == 0


def test_streamed_deltas_add_up(llm):
    engine = llm.engine
    engine.add_request("s", "The quick brown", SamplingParams(max_tokens=12, ignore_eos=True))
    outs = run(engine)["s"]
    assert len(outs) == 12
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].text
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == outs[-1].token_ids
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stop_token_ids_and_stop_strings(llm):
    free = llm.generate("Paris", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    tokens, text = free.token_ids, free.text
    third = tokens[2]
    out = llm.generate("Paris", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               stop_token_ids=[third]), use_tqdm=False)[0]
    first_hit = tokens.index(third)
    assert out.token_ids == tokens[:first_hit + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == third
    stop = text.strip()[2:5]
    out = llm.generate("Paris", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    out = llm.generate([5, 6], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0}),
                       use_tqdm=False)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    out = llm.generate([5, 6], SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0},
                                              ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([5] * 120, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", [5] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_manager.allocator.num_used > 0
    assert engine.stats().requests_tracked == 3  # in the scheduler, as a group, in a batch row
    engine.abort_request("a")
    assert engine.kv_manager.allocator.num_used == 0 and not engine.has_unfinished_requests()
    assert engine.stats().requests_tracked == 0  # its batch row too, though no step follows
    assert engine.step() == []


def test_an_idle_engine_tracks_no_request(llm):
    llm.generate(["a b c", "d e"], SamplingParams(max_tokens=3, n=2, ignore_eos=True, stop=["zz"]), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.requests_tracked == 0 and stats.kv_blocks_used == 0


def test_chat_uses_the_template(llm):
    convo = [{"role": "user", "content": "Hello"}]
    prompt = llm.apply_chat_template(convo)
    assert prompt["prompt"] == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat(convo, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt["prompt_token_ids"] and len(out.token_ids) == 4


def test_outputs_come_back_in_prompt_order(llm):
    prompts = ["a b c d e f g h", "x", "The quick brown fox"]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 1)],
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts and [len(o.token_ids) for o in outs] == [3, 9, 1]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    a = llm.generate(["Paris is"], params, use_tqdm=False)[0].token_ids
    b = llm.generate(["x y z", "Paris is", "The"], params, use_tqdm=False)[1].token_ids
    assert a == b


def test_kv_cache_too_small_names_the_numbers(tiny_llama):
    with pytest.raises(ConfigError, match=r"KV cache is too small: 2e-05 GiB .* holds 2 blocks of 16 tokens .* "
                                          r"max_model_len 128 needs 8 blocks"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.00002)


def test_unknown_backend_and_missing_model(tiny_llama):
    with pytest.raises(BackendNotFoundError, match="unknown backend 'gpu'"):
        LLM(str(tiny_llama), backend="gpu")
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM("/no/such/model")


def test_kv_cache_space_beyond_free_memory_names_both_numbers(tiny_llama):
    with pytest.raises(ConfigError, match=r"KV cache space 100000 GiB \(from --kv-cache-space\) is more than the "
                                          r"[0-9.]+ GiB of memory available"):
        LLM(str(tiny_llama), kv_cache_space=100000)


def test_start_up_runs_one_short_prompt_and_leaves_the_engine_untouched(tiny_llama, monkeypatch):
    """The warm-up meets the first step's one-time costs (kernels, primitives) before any request does."""
    from pagedllm.backends.cpu.backend import CPUBackend

    seen = []
    execute = CPUBackend.execute
    monkeypatch.setattr(CPUBackend, "execute", lambda self, batch: seen.append(batch) or execute(self, batch))
    engine = LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_space=0.01).engine
    (warm_up,) = seen
    assert warm_up.num_seqs == 1 and warm_up.num_tokens == 16 and warm_up.num_decodes == 0
    assert warm_up.slot_mapping.tolist() == list(range(16)) and len(warm_up.logits_indices) == 1
    stats = engine.stats()
    assert stats.steps == 0 and stats.prompt_tokens == 0 and stats.kv_blocks_used == 0


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None or importlib.util.find_spec("scipy") is None,
                    reason="scikit-learn or scipy is not installed here")
def test_building_a_model_leaves_scikit_learn_and_scipy_unimported(tiny_llama, tmp_path):
    """nncf installs scikit-learn and scipy; transformers' model classes would import them for features pagedllm
    never runs (utils.skip_unused_imports). The check runs in a fresh interpreter, where nothing imported them."""
    code = ("import sys, transformers.utils; from pagedllm import LLM, SamplingParams; "
            f"llm = LLM({str(tiny_llama)!r}, dtype='float32', max_model_len=128, kv_cache_space=0.01); "
            "llm.generate(['Hi'], SamplingParams(max_tokens=2)); "
            "print('sklearn' in sys.modules, 'scipy' in sys.modules, transformers.utils.is_sklearn_available(), "
            "transformers.utils.is_scipy_available())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # not imported, and transformers still answers the truth to anyone else who asks
    assert result.stdout.split()[-4:] == ["False", "False", "True", "True"]
