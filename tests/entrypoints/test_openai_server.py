"""`pagedllm serve` on a tiny Llama, driven over HTTP by the official `openai` client (and raw httpx for what the
client cannot send): output parity with the offline API, streaming, n, seeds, logprobs, usage, every error case
followed by a request that still succeeds, disconnects, 50 concurrent streams, /metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess, parse_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

import pagedllm
from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.serving import sse

KEY = "sk-test"
MODEL = "tiny-llama"
ALIAS = "tiny-llama-alias"
MAX_MODEL_LEN = 512
MAX_REQUEST_SIZE = 64 * 1024
IGNORE_EOS = {"ignore_eos": True}
PROMPTS = ["Paris is the capital of", "The quick brown fox"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about Paris"}]
# Replaces the model's own template (--chat-template), so the tests see the override is what renders the messages.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    server = ServerProcess([str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                            "--kv-cache-space", "0.02", "--api-key", KEY, "--max-request-size",
                            str(MAX_REQUEST_SIZE), "--chat-template", str(folder / "template.jinja"),
                            "--served-model-name", MODEL, ALIAS], folder / "server.log")
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_space=0.02)
    yield llm
    llm.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_serves(client) -> None:
    """The server still answers a plain request after an error."""
    out = client.completions.create(model=MODEL, prompt="Paris", max_tokens=3, temperature=0, extra_body=IGNORE_EOS)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


# -- endpoints besides generation ---------------------------------------------------------------------------------
def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    assert all(m.owned_by == "pagedllm" and m.model_extra["max_model_len"] == MAX_MODEL_LEN for m in models)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": pagedllm.__version__}


def test_tokenize_and_detokenize(server, tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "Paris"}).status_code == 401  # behind the key too
    auth = {"Authorization": f"Bearer {KEY}"}
    out = httpx.post(server.url + "/tokenize", json={"prompt": "Paris is the capital of"}, headers=auth).json()
    assert out["tokens"] == tokenizer("Paris is the capital of").input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    for add_generation_prompt in (True, False):
        out = httpx.post(server.url + "/tokenize", headers=auth, json={
            "messages": MESSAGES, "model": ALIAS, "add_generation_prompt": add_generation_prompt}).json()
        text = tokenizer.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        assert text.startswith("system: You are terse.\n")
        assert out["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    ids = tokenizer("The quick brown fox").input_ids
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=auth).json() == {
        "prompt": "The quick brown fox"}


# -- parity with the offline API ----------------------------------------------------------------------------------
def test_greedy_completions_equal_llm_generate(client, llm):
    expected = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert out.usage.completion_tokens == 48 and out.usage.total_tokens == out.usage.prompt_tokens + 48
    by_ids = client.completions.create(model=ALIAS, prompt=expected[0].prompt_token_ids, max_tokens=24,
                                       temperature=0, extra_body=IGNORE_EOS)
    assert by_ids.choices[0].text == expected[0].text and by_ids.model == ALIAS


def test_greedy_chat_equals_llm_chat(client, llm):
    expected = llm.chat(MESSAGES, greedy(24), chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
    for limit in ({"max_tokens": 24}, {"max_completion_tokens": 24}):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS,
                                             **limit)
        choice = out.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == expected.text
        assert choice.finish_reason == "length" and out.object == "chat.completion"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected.prompt_token_ids), 24)


def test_sampling_fields_map_like_the_offline_api(client, llm):
    """Every sampling field the server takes reaches the engine: seeded output equals LLM.generate's."""
    params = dict(temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=20)
    vllm_fields = dict(top_k=40, min_p=0.02, repetition_penalty=1.1, min_tokens=5, ignore_eos=True,
                       skip_special_tokens=False)
    expected = llm.generate("Paris is", SamplingParams(**params, **vllm_fields, logit_bias={200: 3.0}),
                            use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt="Paris is", logit_bias={"200": 3.0}, extra_body=vllm_fields,
                                    **params)
    assert out.choices[0].text == expected.text


def test_allowed_token_ids_and_bad_words(client, llm):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"allowed_token_ids": [40, 41, 42], **IGNORE_EOS}).choices[0]
    assert set(out.logprobs.tokens) <= {llm.tokenizer.decode([t]) for t in (40, 41, 42)}
    plain = llm.generate("Paris is", greedy(8), use_tqdm=False)[0].token_ids
    word = llm.tokenizer.decode(plain[:2])
    banned = llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)[0].token_ids
    assert banned != plain and word not in llm.tokenizer.decode(banned)
    served = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [word], **IGNORE_EOS}).choices[0].text
    assert served == llm.tokenizer.decode(banned)


def test_stop_strings_and_stop_token_ids(client, llm):
    free = llm.generate("Paris is", greedy(16), use_tqdm=False)[0]
    stop = free.text[4:7]
    for fields in ({"stop": [stop]}, {"stop": stop, "extra_body": {"include_stop_str_in_output": True, **IGNORE_EOS}},
                   {"extra_body": {"stop_token_ids": [free.token_ids[3]], **IGNORE_EOS}}):
        extra = fields.pop("extra_body", IGNORE_EOS)
        params = SamplingParams(temperature=0, max_tokens=16, **{**fields, **extra})
        expected = llm.generate("Paris is", params, use_tqdm=False)[0]
        out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=16, temperature=0,
                                        extra_body=extra, **fields).choices[0]
        assert (out.text, out.finish_reason) == (expected.text, "stop")
        assert out.model_extra["stop_reason"] == expected.outputs[0].stop_reason


# -- streaming ----------------------------------------------------------------------------------------------------
def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=20, temperature=0, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(**kwargs, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


def test_streamed_chat_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage == whole.usage


def test_echo_prepends_the_prompt(client):
    kwargs = dict(model=MODEL, prompt="Paris is", max_tokens=6, temperature=0, echo=True, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs).choices[0].text
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0].text
    assert whole == "Paris is" + plain
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].text == "Paris is" and "".join(c.choices[0].text for c in chunks) == whole


# -- n, seeds -----------------------------------------------------------------------------------------------------
def test_n2_completions(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS, n=2, max_tokens=12, temperature=1.0, seed=11, extra_body=IGNORE_EOS)
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]  # prompt i, sequence j -> index 2 * i + j
    assert whole.usage.completion_tokens == 48
    assert whole.choices[0].text != whole.choices[1].text
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}


def test_n2_chat(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, n=2, max_tokens=12, temperature=1.0, seed=5, extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 24
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in whole.choices}


def test_seeded_sampling_is_reproducible_across_calls(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Paris is", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body=IGNORE_EOS).choices[0].text

    assert sample(1) == sample(1)
    assert len({sample(1), sample(2), sample(3)}) > 1


# -- logprobs -----------------------------------------------------------------------------------------------------
def hf_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The oracle: transformers' float32 log-softmax of each generated token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(output_ids)]


def test_completion_logprobs_match_transformers(client, llm, tiny_llama_dir):
    expected = llm.generate("Paris is", greedy(10), use_tqdm=False)[0]
    oracle = hf_logprobs(tiny_llama_dir, expected.prompt_token_ids, expected.token_ids)
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=10, temperature=0, logprobs=3,
                                    extra_body=IGNORE_EOS).choices[0]
    lp = out.logprobs
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in expected.token_ids]
    assert lp.token_logprobs == pytest.approx(oracle, abs=1e-4)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and top[token] == logprob == max(top.values())  # greedy: the best one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt="Paris is", max_tokens=10, temperature=0, logprobs=3, stream=True, extra_body=IGNORE_EOS)]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_chat_logprobs(client, llm, tiny_llama_dir):
    expected = llm.chat(MESSAGES, greedy(8), chat_template=CHAT_TEMPLATE, use_tqdm=False)[0]
    oracle = hf_logprobs(tiny_llama_dir, expected.prompt_token_ids, expected.token_ids)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body=IGNORE_EOS).choices[0]
    content = out.logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t]) for t in expected.token_ids]
    assert [c.logprob for c in content] == pytest.approx(oracle, abs=1e-4)
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == c.logprob  # greedy: the sampled token is the best one
    only_sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                                  logprobs=True, extra_body=IGNORE_EOS).choices[0].logprobs.content
    assert [len(c.top_logprobs) for c in only_sampled] == [0, 0, 0]


# -- scoring: prompt logprobs, as lm-evaluation-harness asks for them --------------------------------------------
def hf_prompt_logprobs(model_dir, prompt_ids: list[int]) -> list[float]:
    """The oracle: transformers' float32 log-softmax of each prompt token after the first."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    return [logprobs[i - 1, t].item() for i, t in enumerate(prompt_ids) if i]


def loglikelihood(server, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's local-completions loglikelihood request and its parsing of the answer, as it sends and reads them."""
    payload = {"model": MODEL, "prompt": [context + continuation], "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}
    response = httpx.post(server.url + COMPLETIONS, json=payload, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    ctxlen = len(context)
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, top_logprobs))
    return sum(token_logprobs), is_greedy


def test_lm_eval_loglikelihood_requests_score_like_transformers(server, tiny_llama_dir, llm):
    ids = llm.tokenizer("Paris is the capital of France; Berlin is the capital of Germany.").input_ids
    oracle = hf_prompt_logprobs(tiny_llama_dir, ids)
    for split in (3, len(ids) - 4):
        total, greedy_ = loglikelihood(server, ids[:split], ids[split:])
        assert total == pytest.approx(sum(oracle[split - 1:]), abs=1e-3)
        assert isinstance(greedy_, bool)
    # the whole answer: the prompt's tokens (the first with no logprob), then the one generated
    out = client_completion(server, {"prompt": ids, "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0})
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(oracle, abs=1e-4)
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert out["text"].startswith(llm.tokenizer.decode(ids))


def client_completion(server, body: dict) -> dict:
    response = httpx.post(server.url + COMPLETIONS, json={"model": MODEL, **body},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_max_tokens_0_with_echo_scores_the_prompt_only(server, client, tiny_llama_dir, llm):
    ids = llm.tokenizer("The quick brown fox jumps over the lazy dog.").input_ids
    oracle = hf_prompt_logprobs(tiny_llama_dir, ids)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    choice = out.choices[0]
    assert choice.text == llm.tokenizer.decode(ids) and out.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1:] == pytest.approx(oracle,
                                                                                                             abs=1e-4)
    streamed = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in streamed if c.choices[0].logprobs), []) == \
        choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)


def test_vllm_prompt_logprobs_field(server, client, tiny_llama_dir, llm):
    out = client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 1})
    ids = llm.tokenizer("Paris is the capital of").input_ids
    entries = out.choices[0].prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    oracle = hf_prompt_logprobs(tiny_llama_dir, ids)
    for token_id, entry, expected in zip(ids[1:], entries[1:], oracle):
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-4)
        assert entry[str(token_id)]["decoded_token"] == llm.tokenizer.decode([token_id])
        assert min(e["rank"] for e in entry.values()) == 1 and len(entry) <= 2
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    with pytest.raises(openai.BadRequestError) as info:  # over --max-logprobs
        client.completions.create(model=MODEL, prompt="x", extra_body={"prompt_logprobs": 21})
    assert info.value.param == "prompt_logprobs"


def test_unknown_fields_are_ignored_as_vllm_does(client):
    extra = {"store": False, "metadata": {"k": "v"}, "reasoning_effort": "low", "some_future_field": [1, 2]}
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0, extra_body=extra)
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra).choices[0].text


def test_usage_details_and_continuous_usage_stats(client):
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # prefix caching is off on this server
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert out.system_fingerprint.startswith("fp_") and chat.system_fingerprint == out.system_fingerprint
    chunks = list(client.completions.create(model=MODEL, prompt="Paris is", max_tokens=3, stream=True,
                                            extra_body=IGNORE_EOS,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 3 and chunks[-1].usage.completion_tokens == 3


# -- bad input ----------------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {
    # name: (path, body, status, param, part of the message)
    "prompt-too-long": (COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt",
                        "the prompt has 600 tokens, more than max_model_len 512"),
    "chat-prompt-too-long": (CHAT, {"messages": [{"role": "user", "content": "Paris " * 600}]}, 400, "prompt",
                             "more than max_model_len 512"),
    "max-tokens-past-the-context": (COMPLETIONS, {"prompt": [5] * 500, "max_tokens": 20}, 400, "max_tokens",
                                    "the prompt has 500 tokens and max_model_len is 512, so at most 12"),
    "wrong-type": (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "valid integer"),
    "wrong-type-in-a-message": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages"),
    "missing-field": (CHAT, {"model": MODEL}, 400, "messages", "Field required"),
    "bad-value": (COMPLETIONS, {"prompt": "x", "temperature": -1}, 400, "temperature", "non-negative"),
    "n-zero": (CHAT, {"messages": USER, "n": 0}, 400, "n", "at least 1"),
    "unsupported-fields": (CHAT, {"messages": USER, "functions": [{"name": "f"}], "best_of": 2}, 400, "functions",
                           "functions, best_of"),
    "auto-tool-choice-off": (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
                             400, "tool_choice", "needs the server started with --enable-auto-tool-choice"),
    "suffix": (COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    "priority-without-its-policy": (CHAT, {"messages": USER, "priority": 1}, 400, "priority",
                                    "--scheduling-policy priority"),
    "stream-options-without-stream": (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
                                      "stream_options", "stream=true"),
    "top-logprobs-without-logprobs": (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    "logit-bias-key": (COMPLETIONS, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids"),
    "image-content": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                      400, "messages", "'image_url' are not supported"),
    "seed-past-64-bits": (COMPLETIONS, {"prompt": "x", "seed": 2**80}, 400, "seed", "less than or equal to"),
    "seed-past-64-bits-chat": (CHAT, {"messages": USER, "seed": -(2**70)}, 400, "seed", "greater than or equal"),
    "no-messages": (CHAT, {"messages": []}, 400, "messages", "at least 1 item"),
    "tokenize-no-messages": ("/tokenize", {"messages": []}, 400, "messages", "at least 1 item"),
    "unknown-model": (COMPLETIONS, {"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_is_refused_and_the_server_keeps_serving(server, client, name):
    path, body, status, param, message = BAD_REQUESTS[name]
    response = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    assert_serves(client)


def test_errors_through_the_openai_client(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=1)
    assert info.value.param == "prompt" and "600" in info.value.message and "512" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=USER)
    assert info.value.body["code"] == 404 and info.value.param == "model"  # vLLM's integer code
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError) as info:
            intruder.completions.create(model=MODEL, prompt="x")
    assert info.value.status_code == 401 and info.value.body["code"] == 401
    with pytest.raises(openai.BadRequestError, match="needs echo"):  # refused before a stream starts
        client.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=0)
    assert_serves(client)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not-bearer"])
def test_api_key_is_required_on_v1_only(server, client, headers):
    response = httpx.post(server.url + COMPLETIONS, json={"prompt": "x"}, headers=headers)
    assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # like vLLM: only /v1 needs the key
    assert_serves(client)


def test_malformed_json_is_a_400(server, client):
    response = httpx.post(server.url + COMPLETIONS, content=b'{"prompt": "x",', timeout=60,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    assert_serves(client)


def test_bodies_over_the_limit_are_a_413(server, client):
    body = ('{"prompt": "' + "a" * MAX_REQUEST_SIZE + '"}').encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    declared = httpx.post(server.url + COMPLETIONS, content=body, headers=headers, timeout=60)
    chunked = httpx.post(server.url + COMPLETIONS, content=iter([body[:1000], body[1000:]]), headers=headers,
                         timeout=60)  # no Content-Length: the limit applies while reading
    for response in (declared, chunked):
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == 413 and str(MAX_REQUEST_SIZE) in error["message"]
    assert_serves(client)


# -- disconnects, concurrency, metrics ----------------------------------------------------------------------------
def test_a_client_leaving_mid_stream_aborts_its_request_and_frees_its_blocks(server, client):
    before = server.wait_idle()
    stream = client.completions.create(model=MODEL, prompt="Paris", max_tokens=500, stream=True,
                                       extra_body=IGNORE_EOS)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    busy = server.metrics()
    assert busy["vllm:num_requests_running"] == 1 and busy["vllm:kv_cache_usage_perc"] > 0
    stream.close()
    after = server.wait_idle()
    assert after["vllm:kv_cache_usage_perc"] == 0 and after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 500  # aborted, not done
    assert_serves(client)


def test_a_client_leaving_a_non_streamed_request_aborts_it(server, client):
    before = server.wait_idle()

    async def leave_midway() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            request = asyncio.create_task(http.post(COMPLETIONS, headers={"Authorization": f"Bearer {KEY}"}, json={
                "prompt": "Paris", "max_tokens": 500, "ignore_eos": True}))
            while await running(http) == 0:
                assert not request.done(), "the request ended before it was seen running"
                await asyncio.sleep(0.01)
            request.cancel()

    asyncio.run(leave_midway())
    after = server.wait_idle()
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 500
    assert_serves(client)


def test_50_concurrent_streams_some_leaving_midway(server, client):
    before = server.wait_idle()
    # Leavers ask for many tokens, so that on a fast machine they cannot finish before their abort lands.
    max_tokens, leaver_max_tokens, leavers = 40, 400, set(range(0, 50, 5))

    async def one(api, http, i: int, health: list):
        stream = await api.completions.create(model=MODEL, prompt=f"Request {i}: the quick brown fox", seed=i,
                                              max_tokens=leaver_max_tokens if i in leavers else max_tokens,
                                              stream=True, temperature=0.8,
                                              stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
        if i in leavers:
            async for n, _ in _aenumerate(stream):
                if n == 2:
                    break
            await stream.close()
            return None
        finish, usage = None, None
        async for n, chunk in _aenumerate(stream):
            if n == 0:  # this request is in flight now: the server must still answer health checks
                health.append((await http.get("/health")).status_code)
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return finish, usage.completion_tokens

    async def run(health: list):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as api, \
                httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(one(api, http, i, health) for i in range(50)))

    health: list[int] = []
    results = asyncio.run(run(health))
    assert health == [200] * 40
    finished = [r for i, r in enumerate(results) if i not in leavers]
    assert finished == [("length", max_tokens)] * 40
    after = server.wait_idle()
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert (after["vllm:num_requests_running"], after["vllm:num_requests_waiting"]) == (0, 0)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    # the leavers stopped early: their aborts land within a few seconds, which on 2 loaded cores is up to a few
    # hundred steps of this 50-stream batch (one run read 241 of their 400 tokens on average)
    assert 40 * max_tokens <= generated < 40 * max_tokens + 10 * leaver_max_tokens * 3 // 4
    assert httpx.get(server.url + "/health").status_code == 200
    assert_serves(client)


async def running(http: httpx.AsyncClient) -> float:
    return parse_metrics((await http.get("/metrics")).text)["vllm:num_requests_running"]


async def _aenumerate(stream):
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def test_metrics_follow_a_request(server, client):
    text = httpx.get(server.url + "/metrics").text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert {name: types.get(name) for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")} == dict.fromkeys(
        ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"), "gauge")
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success"):
        assert types.get(name) == "counter", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert types.get(name) == "histogram", name
    assert 'model_name="tiny-llama"' in text

    before = server.wait_idle()
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=5, temperature=0, extra_body=IGNORE_EOS)
    after = server.wait_idle()

    def grew(name):
        return after[name] - before[name]

    assert grew("vllm:prompt_tokens_total") == out.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:time_to_first_token_seconds_count") == 1 and grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 4
    assert grew("vllm:request_time_per_output_token_seconds_count") == 1
    assert grew("vllm:request_success_total[length]") == 1
    assert after["vllm:e2e_request_latency_seconds_sum"] > before["vllm:e2e_request_latency_seconds_sum"]


# -- SIGTERM ------------------------------------------------------------------------------------------------------
def test_sigterm_lets_requests_in_flight_finish_then_exits_0(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.01")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(model="llama", prompt="Paris", max_tokens=200, stream=True,
                                    stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = [next(stream)]
    server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 200
    assert server.proc.wait(60) == 0, server.log()
    with pytest.raises(openai.APIConnectionError):
        api.completions.create(model="llama", prompt="Paris", max_tokens=1)


def test_sigterm_ends_what_outlasts_the_shutdown_timeout_with_an_error_event(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.01",
                          "--shutdown-timeout", "0")
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(model="llama", prompt="Paris", max_tokens=500, stream=True, extra_body=IGNORE_EOS)
    chunks = [next(stream)]
    server.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="the engine was shut down"):  # an error event, not a cut stream
        for chunk in stream:
            chunks.append(chunk)
    assert len(chunks) < 500 and all(c.choices[0].finish_reason is None for c in chunks)
    assert server.proc.wait(60) == 0, server.log()


def test_an_event_stays_one_line_whatever_its_text():
    """A token's text may hold U+0085, U+2028 or U+2029, which JSON leaves raw and line readers built on
    str.splitlines (httpx's aiter_lines) take for line ends: a tiny model's stream was cut mid-event by one."""
    text = "a\x85b\u2028c\u2029d\x1ce"
    event = sse({"text": text})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event.removeprefix("data: ")) == {"text": text}
