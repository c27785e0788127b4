"""--reasoning-parser: <think>...</think> text goes to reasoning_content, whole or streamed in any pieces, and the
server gives it (a regex constraint makes the tiny model write a thinking model's output)."""

from __future__ import annotations

import openai
import pytest

from pagedllm.entrypoints.openai.cli_args import REASONING_PARSERS
from pagedllm.entrypoints.openai.reasoning import ReasoningStream, split_reasoning

CASES = {
    # name: (parser, text, reasoning, content)
    "r1-opened-by-the-template": ("deepseek_r1", "Let me think.</think>\n\nParis.", "Let me think.", "Paris."),
    "r1-written-tag": ("deepseek_r1", "<think>Hmm</think>Paris", "Hmm", "Paris"),
    "r1-never-closed": ("deepseek_r1", "still thinking", "still thinking", ""),
    "qwen3-thinking": ("qwen3", "<think>\nSmall sum.\n</think>\n\n4", "\nSmall sum.\n", "4"),
    "qwen3-not-thinking": ("qwen3", "4, no thought </think> here", None, "4, no thought </think> here"),
    "qwen3-tag-not-at-start": ("qwen3", "Answer: <think>x</think>", None, "Answer: <think>x</think>"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_reasoning_equals_the_whole(name, size):
    parser, text, reasoning, content = CASES[name]
    assert split_reasoning(parser, text) == (reasoning, content)
    stream = ReasoningStream(parser)
    got_reasoning, got_content = "", ""
    for i in range(0, len(text), size):
        r, c = stream.feed(text[i:i + size])
        got_reasoning, got_content = got_reasoning + r, got_content + c
    r, c = stream.finish()
    assert (got_reasoning + r, got_content + c) == (reasoning or "", content)


def test_the_parsers_the_cli_offers_are_these():
    assert REASONING_PARSERS == ("deepseek_r1", "qwen3")


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    from server_process import ServerProcess

    server = ServerProcess([str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.01",
                            "--reasoning-parser", "qwen3"], tmp_path_factory.mktemp("reasoning") / "server.log")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        yield client
    server.stop()


THINKING = {"structured_outputs": {"regex": "<think>[a-z ]{4,12}</think>[a-z]{2,6}"}}


def test_the_server_splits_reasoning_whole_and_streamed(client):
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=40,
                                         temperature=0, extra_body=THINKING).choices[0].message
    reasoning = out.model_extra["reasoning_content"]
    assert reasoning and out.content and "<think>" not in out.content + reasoning
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                                 max_tokens=40, temperature=0, stream=True, extra_body=THINKING))
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.content
