"""Structured outputs and tool calls through `pagedllm serve` (the default SmolLM2, auto tool choice on) and the
`openai` client: response_format, structured_outputs and guided_* on both endpoints; named, required and auto (hermes)
tool calls; streamed and whole give the same; bad constraints are 400s that name the field and the problem."""

from __future__ import annotations

import json
import re
import signal

import jsonschema
import openai
import pytest
from server_process import ServerProcess

from pagedllm.models.source import DEFAULT_MODEL_NAME as MODEL

pytestmark = pytest.mark.slow
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = ServerProcess(["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-space", "0.1",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                           tmp_path_factory.mktemp("structured") / "server.log")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        yield client
    assert server.stop(signal.SIGTERM) == 0, server.log()


def chat_both(client, **kwargs):
    """The whole response, and the streamed one merged: (message content, tool calls, finish reason) of each."""
    whole = client.chat.completions.create(model=MODEL, temperature=0, **kwargs).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, temperature=0, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    whole_calls = [{"name": c.function.name, "arguments": c.function.arguments}
                   for c in whole.message.tool_calls or []]
    assert all(c.id.startswith("call_") for c in whole.message.tool_calls or [])
    assert (whole.message.content or "", whole_calls, whole.finish_reason) == (content, list(calls.values()), finish)
    return whole.message.content, whole_calls, whole.finish_reason


def test_json_schema_response_format(client):
    content, calls, finish = chat_both(client, messages=[{"role": "user", "content": "Give me a person as JSON."}],
                                       max_tokens=48, response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": PERSON, "strict": True}})
    assert finish == "stop" and not calls
    jsonschema.validate(json.loads(content), PERSON)


def test_json_object_on_completions_and_seeded_sampling(client):
    out = client.completions.create(model=MODEL, prompt="A JSON object describing Paris:", max_tokens=32, n=2,
                                    temperature=1.0, seed=5, extra_body={"response_format": {"type": "json_object"}})
    for choice in out.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.finish_reason == "length" and choice.text.startswith("{")


def test_choice_and_regex_in_both_spellings(client):
    yes_no = ["yes", "no"]
    for extra in ({"structured_outputs": {"choice": yes_no}}, {"guided_choice": yes_no}):
        out = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=5,
                                        temperature=0, extra_body=extra)
        assert out.choices[0].text in yes_no and out.choices[0].finish_reason == "stop"
    for extra in ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, {"guided_regex": r"\d{3}-\d{4}"}):
        content, _, finish = chat_both(client, messages=[{"role": "user", "content": "A phone number?"}],
                                       max_tokens=16, extra_body=extra)
        assert re.fullmatch(r"\d{3}-\d{4}", content) and finish == "stop"


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_named_and_required_tool_calls(client, tool_choice):
    content, calls, finish = chat_both(client, messages=ASK, max_tokens=64, tools=TOOLS, tool_choice=tool_choice)
    assert content is None and finish == "tool_calls" and calls
    for call in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)
    if tool_choice != "required":
        assert [c["name"] for c in calls] == ["get_weather"]


def test_auto_tool_choice_parses_hermes_tool_calls(client):
    """SmolLM2 does not write tool calls on its own: a regex makes it write one in the hermes format."""
    text = 'Sure.\n<tool_call>{"name": "get_time", "arguments": {"city": "Paris"}}</tool_call>'
    regex = re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)  # the regex that matches only the text
    content, calls, finish = chat_both(client, messages=ASK, max_tokens=100, tools=TOOLS, tool_choice="auto",
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert calls == [{"name": "get_time", "arguments": '{"city": "Paris"}'}]
    # tool_choice "none": the same text stays content
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100, tools=TOOLS, tool_choice="none",
                                         temperature=0, extra_body={"guided_regex": regex})
    assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls


def test_a_grammar_cut_by_max_tokens_ends_with_length(client):
    content, _, finish = chat_both(client, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=4,
                                   extra_body={"guided_json": PERSON})
    assert finish == "length" and content.startswith('{"name"')
    _, calls, finish = chat_both(client, messages=ASK, max_tokens=4, tools=TOOLS, tool_choice="required")
    assert finish == "length"


BAD = {
    # name: (request kwargs, param, part of the message)
    "bad-schema": (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}), "response_format", 'the JSON schema is invalid: Unsupported type "objekt"'),
    "bad-regex": (dict(extra_body={"guided_regex": "(ab"}), "guided_regex", "the regex is invalid"),
    "bad-grammar": (dict(extra_body={"structured_outputs": {"grammar": "root ::= "}}), "structured_outputs",
                    "the grammar is invalid"),
    "unknown-key": (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs", "jsn"),
    "two-constraints": (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
                        "guided_regex", "response_format, guided_regex"),
    "constraint-with-required-tools": (dict(tools=TOOLS, tool_choice="required", extra_body={"guided_regex": "a"}),
                                       "guided_regex", "cannot be combined with tool_choice required"),
    "unknown-function": (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                         "tool_choice", "'nope', which is not among the tools"),
    "bad-tool-parameters": (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], tool_choice="required"), "tools", "Unsupported type"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_constraints_are_400s_naming_the_problem(client, name):
    kwargs, param, message = BAD[name]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    assert info.value.param == param and message in info.value.message
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert out.choices[0].finish_reason == "length"
