"""A step that raises (in backend.execute or in the sampler) ends only the requests it ran, with an error; their
blocks are freed and what it published in the prefix cache is withdrawn; the engine serves the others and later
requests. Too many failed steps in a row kill it. On a tiny Llama, through the test-only ``faulty`` backend plugin
(the cpu backend, raising on command)."""

from __future__ import annotations

import faulty_backend
import pytest
from tiny_models import build_model

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import BackendDeadError
from pagedllm.models.source import default_embedding_model_path
from pagedllm.plugins.manager import register_plugin, unregister_plugin
from pagedllm.pooling.params import PoolingParams

PROMPTS = {"a": [1, 5, 9, 13, 17], "b": [2, 4, 6, 8], "c": [3, 7, 11, 15, 19, 23], "d": [30, 31, 32]}
LONG_PROMPT = list(range(10, 40))  # 3 full blocks of 8 and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("faults") / "llama")


@pytest.fixture
def faults(monkeypatch, tmp_path):
    """The faulty backend registered in-process; the file that arms it."""
    register_plugin(faulty_backend, name=faulty_backend.NAME)
    path = tmp_path / "faults"
    monkeypatch.setenv(faulty_backend.FAULTS_ENV, str(path))
    yield path
    unregister_plugin(faulty_backend.NAME)


def engine(model, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        model=str(model), backend=faulty_backend.NAME, dtype="float32", kv_cache_space=0.01, max_num_seqs=2,
        **kwargs))


def run(engine: LLMEngine, outputs: dict | None = None) -> dict:
    """Step until idle: {request id: final output}."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def add(engine: LLMEngine, *names: str, prompts=PROMPTS) -> None:
    for name in names:
        engine.add_request(name, prompts[name], GREEDY)


def assert_nothing_held(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert engine.unfinished_request_ids() == [] and engine.scheduler.requests == {}
    assert stats.requests_tracked == 0


class InjectedSamplerFault(RuntimeError):
    pass


def fail_the_sampler_for(engine: LLMEngine, monkeypatch, request_id: str):
    """The sampler raises whenever it samples ``request_id`` (as if that request's parameters broke it); returns
    the function that puts the real sampler back."""
    sampler = engine.sampler

    def failing(logits, requests):
        if any(r.group_id == request_id for r in requests):
            raise InjectedSamplerFault("injected sampler fault")
        return sampler(logits, requests)

    monkeypatch.setattr(engine, "sampler", failing)
    return lambda: monkeypatch.setattr(engine, "sampler", sampler)


@pytest.mark.parametrize("where", ["backend", "sampler"])
def test_a_failing_step_fails_only_its_requests(model, faults, monkeypatch, where):
    e = engine(model)
    add(e, *PROMPTS)
    expected = {name: out.outputs[0].token_ids for name, out in run(e).items()}

    add(e, *PROMPTS)  # max_num_seqs 2: a and b run, c and d wait
    e.step()
    if where == "backend":  # the step fails: both requests in it end
        faulty_backend.arm(faults)
        failing = {"a", "b"}
    else:  # sampling fails for a alone: b samples on
        restore = fail_the_sampler_for(e, monkeypatch, "a")
        failing = {"a"}
    outputs = e.step()
    if where == "sampler":
        restore()
    failed = [o for o in outputs if o.error is not None]
    assert {o.request_id for o in failed} == failing
    assert all(o.finished and o.outputs == [] and "Injected" in o.error for o in failed)
    if where == "backend":
        assert e.stats().kv_blocks_used == 0  # a's and b's blocks are back; c and d have not started
    rest = run(e)
    assert set(rest) == set(PROMPTS) - failing
    assert {name: out.outputs[0].token_ids for name, out in rest.items()} == {name: expected[name] for name in rest}
    assert all(out.error is None for out in rest.values())

    add(e, "a")  # the failed request, again
    assert run(e)["a"].outputs[0].token_ids == expected["a"]
    assert_nothing_held(e)
    e.shutdown()


@pytest.mark.parametrize("where", ["backend", "sampler"])
def test_no_later_request_reuses_the_blocks_of_a_failed_prefill(model, faults, monkeypatch, where):
    """The cpu backend publishes a prompt's full blocks when they are allocated, the engine after a step ran: a
    fault in the backend leaves published blocks that may be half written, and they are withdrawn. A fault in the
    sampler comes after the forward pass wrote them whole: they stay cached, and the retry reuses them."""
    e = engine(model, enable_prefix_caching=True)
    prompts = {"long": LONG_PROMPT}
    add(e, "long", prompts=prompts)
    expected = run(e)["long"].outputs[0].token_ids
    num_cached = len(e.kv_manager.prefix_cache)
    e.shutdown()

    e = engine(model, enable_prefix_caching=True)
    add(e, "long", prompts=prompts)
    if where == "backend":
        faulty_backend.arm(faults)
    else:
        restore = fail_the_sampler_for(e, monkeypatch, "long")
    [failed] = e.step()
    if where == "sampler":
        restore()
    assert failed.error is not None
    assert (len(e.kv_manager.prefix_cache) == 0) == (where == "backend")
    add(e, "long", prompts=prompts)
    assert run(e)["long"].outputs[0].token_ids == expected
    assert (e.stats().prefix_cache_hits == 0) == (where == "backend")
    assert len(e.kv_manager.prefix_cache) == num_cached  # what the retry computed is cached as usual
    e.shutdown()


def test_consecutive_failures_kill_the_engine_and_a_success_resets_the_count(model, faults):
    e = engine(model, max_consecutive_step_failures=2)
    for _ in range(2):  # fail, succeed: never two in a row
        add(e, "a")
        faulty_backend.arm(faults)
        assert e.step()[0].error is not None
        add(e, "a")
        assert run(e)["a"].error is None
    add(e, "a")
    faulty_backend.arm(faults, 2)
    assert e.step()[0].error is not None
    add(e, "b")
    with pytest.raises(faulty_backend.InjectedFault):
        e.step()
    e.shutdown()


def test_a_dead_backend_stops_the_engine_at_its_first_failure(model, faults, monkeypatch):
    """A backend that cannot run further steps (a worker process died) says so with BackendDeadError: no retries."""
    e = engine(model)
    add(e, "a")

    def dead(batch):
        raise BackendDeadError("worker 1 died")

    monkeypatch.setattr(e.backend, "execute", dead)
    with pytest.raises(BackendDeadError, match="worker 1 died"):
        e.step()
    e.shutdown()


def test_llm_generate_reports_the_error_on_the_output(model, faults):
    llm = LLM(str(model), backend=faulty_backend.NAME, dtype="float32", kv_cache_space=0.01, max_num_seqs=1)
    faulty_backend.arm(faults)
    first, second = llm.generate([PROMPTS["a"], PROMPTS["b"]], GREEDY, use_tqdm=False)
    assert "InjectedFault" in first.error and first.outputs == []
    assert second.error is None and len(second.outputs[0].token_ids) == 6
    llm.shutdown()


def test_a_failing_schedule_counts_as_a_failed_step(model, faults, monkeypatch):
    """schedule() runs inside the step's isolation: once is survived, max_consecutive_step_failures in a row stop
    the engine."""
    e = engine(model)
    add(e, "a")
    real = e.scheduler.schedule
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected schedule fault")
        return real()

    monkeypatch.setattr(e.scheduler, "schedule", failing)
    assert e.step() == []
    assert run(e)["a"].error is None
    monkeypatch.setattr(e.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("always")))
    add(e, "b")
    with pytest.raises(RuntimeError, match="always"):
        for _ in range(e.config.max_consecutive_step_failures):
            e.step()
    e.shutdown()


def test_a_failing_verify_step_fails_its_request_and_frees_its_blocks(model, faults, monkeypatch):
    """Speculative decoding: a step that fails while checking proposals ends its request with an error, frees its
    blocks (proposed tokens' KV included), and the engine serves the same request again to the same tokens."""
    e = engine(model, enable_prefix_caching=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 8})
    prompts = {"s": list(range(3, 380))}  # nearly the whole vocabulary: whatever comes next is in the prompt
    add(e, "s", prompts=prompts)
    expected = run(e)["s"].outputs[0].token_ids
    assert e.stats().spec_draft_tokens > 0
    verify = e._verify_proposals

    def failing(*args, **kwargs):
        raise InjectedSamplerFault("injected verify fault")

    monkeypatch.setattr(e, "_verify_proposals", failing)
    add(e, "s", prompts=prompts)
    failed = run(e)["s"]
    assert failed.error is not None and "Injected" in failed.error
    assert e.stats().kv_blocks_used == 0
    monkeypatch.setattr(e, "_verify_proposals", verify)
    add(e, "s", prompts=prompts)
    assert run(e)["s"].outputs[0].token_ids == expected
    assert_nothing_held(e)
    e.shutdown()


def test_a_failing_pooling_step_fails_only_its_requests(faults):
    """The pooling runner (embeddings): a failed forward pass ends the requests it ran with an error, the engine
    embeds the next ones, and nothing stays queued."""
    e = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
        model=str(default_embedding_model_path()), backend=faulty_backend.NAME, runner="pooling", dtype="float32",
        max_num_seqs=2))
    texts = {"a": "A man is eating food.", "b": "A man rides a horse.", "c": "Rain in Paris."}
    for name, text in texts.items():
        e.add_request(name, text, PoolingParams())
    faulty_backend.arm(faults)
    first = e.step()  # a and b: max_num_seqs 2
    assert {o.request_id for o in first} == {"a", "b"} and all("Injected" in o.error for o in first)
    rest = run(e)
    assert set(rest) == {"c"} and rest["c"].error is None and len(rest["c"].embedding) == 384
    e.add_request("a", texts["a"], PoolingParams())
    assert run(e)["a"].error is None
    assert e.unfinished_request_ids() == []
    e.shutdown()
