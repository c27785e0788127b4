"""AsyncLLMEngine on a tiny Llama, with the engine on a thread and in an engine-core process: it serves asyncio
callers, adds are all or none, leaving a stream aborts it, the engine sleeps when idle, and shutdown ends what is in
flight."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm import LLM, EngineArgs, InvalidRequestError, SamplingParams
from pagedllm.engine.async_llm import AsyncLLMEngine, EngineDeadError, StepLatencies

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["Paris is the capital of", "The quick brown fox", "A paged KV cache"]


@pytest.fixture(scope="module")
def engine_args(tiny_llama_dir) -> EngineArgs:
    return EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, kv_cache_space=0.01)


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def engine_process(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def engine(engine_args, engine_process):
    engine = AsyncLLMEngine(engine_args, engine_process=engine_process)
    yield engine
    engine.shutdown()


async def collect(stream) -> dict[str, list]:
    outputs: dict[str, list] = {}
    async with stream:
        async for output in stream:
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


async def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_concurrent_callers_get_what_llm_generate_gives(engine, engine_args):
    async def one(i: int, prompt: str):
        return await collect(await engine.add([(f"r{i}", prompt, GREEDY)]))

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    results = asyncio.run(run())
    expected = LLM(**vars(engine_args)).generate(PROMPTS, GREEDY, use_tqdm=False)
    for i, (outputs, reference) in enumerate(zip(results, expected)):
        steps = outputs[f"r{i}"]
        assert steps[-1].finished and not any(s.finished for s in steps[:-1])
        assert steps[-1].outputs[0].token_ids == reference.token_ids
        assert "".join(s.outputs[0].delta_text for s in steps) == reference.text


def test_adds_are_all_or_none(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="more than max_model_len 256") as info:
            await engine.add([("ok", "Paris", GREEDY), ("long", [5] * 300, GREEDY)])
        assert info.value.param == "prompt"
        return await collect_one(engine, "ok")  # the id is free again: the first request was not kept

    outputs = asyncio.run(run())
    assert outputs["ok"][-1].finished


def test_leaving_a_stream_aborts_the_request_and_frees_its_blocks(engine):
    async def run():
        stream = await engine.add([("leaver", "Paris", SamplingParams(max_tokens=200, ignore_eos=True))])
        async with stream:
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 3:
                    break
        await wait_until(lambda: engine.stats.num_running == 0 and engine.stats.kv_cache_usage == 0)
        return engine.stats

    before = engine.stats.generation_tokens
    stats = asyncio.run(run())
    assert stats.generation_tokens - before < 200


def test_the_thread_sleeps_when_idle(engine):
    asyncio.run(collect_one(engine, "idle-check"))
    steps = engine.stats.steps
    time.sleep(0.3)
    assert engine.stats.steps == steps


async def collect_one(engine, request_id: str):
    return await collect(await engine.add([(request_id, "Paris", GREEDY)]))


def test_on_step_reports_latencies(engine):
    seen: list[StepLatencies] = []
    engine.on_step = seen.append
    try:
        asyncio.run(collect_one(engine, "timed"))
    finally:
        engine.on_step = None
    assert sum(len(s.time_to_first_token) for s in seen) == 1
    assert sum(len(s.inter_token_latency) for s in seen) == GREEDY.max_tokens - 1
    finished = [o for s in seen for o in s.finished]
    assert [o.request_id for o in finished] == ["timed"]
    assert all(x >= 0 for s in seen for x in s.time_to_first_token + s.inter_token_latency)


def test_shutdown_ends_streams_in_flight_and_refuses_new_requests(engine_args, engine_process):
    engine = AsyncLLMEngine(engine_args, engine_process=engine_process)

    async def run():
        stream = await engine.add([("long", "Paris", SamplingParams(max_tokens=200, ignore_eos=True))])
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add([("late", "Paris", GREEDY)])

    asyncio.run(run())
    assert engine.dead is not None and engine.stats.kv_cache_usage == 0


def test_a_request_aborted_before_its_add_is_acknowledged_is_forgotten(engine):
    async def run():
        adding = asyncio.ensure_future(engine.add([("early", "Paris", SamplingParams(max_tokens=200,
                                                                                    ignore_eos=True))]))
        await asyncio.sleep(0)  # the add is submitted, its acknowledgement not yet received
        adding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await adding
        await wait_until(lambda: engine.stats.num_running == 0 and engine.stats.kv_cache_usage == 0)
        return await collect_one(engine, "after-early")

    assert asyncio.run(run())["after-early"][-1].finished
    assert "early" not in engine._routes


def test_a_request_id_can_be_reused_right_after_its_abort(engine, engine_args):
    async def run():
        stream = await engine.add([("reused", "Paris", SamplingParams(max_tokens=200, ignore_eos=True))])
        await stream.__anext__()
        stream.abort()
        return await collect(await engine.add([("reused", PROMPTS[1], GREEDY)]))

    outputs = asyncio.run(run())["reused"]
    [expected] = LLM(**vars(engine_args)).generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected.token_ids


def test_a_request_id_in_use_is_refused(engine):
    async def run():
        stream = await engine.add([("twice", "Paris", SamplingParams(max_tokens=50, ignore_eos=True))])
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add([("twice", "Paris", GREEDY)])
        stream.abort()

    asyncio.run(run())
