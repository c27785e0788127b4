"""Tool-call parsing and the request fields of structured outputs, without a model: every way of cutting a text into
deltas streams the same calls as the whole text; what each tool_choice asks for; conflicts and bad values."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.tool_calls import ToolCalling
from pagedllm.sampling_params import StructuredOutputsParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
USER = [{"role": "user", "content": "hi"}]


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def calling(tool_choice, parser: str | None = "hermes", **fields) -> ToolCalling:
    return ToolCalling.for_request(chat_request(tools=TOOLS, tool_choice=tool_choice, **fields), parser)


def streamed(tools: ToolCalling, text: str, size: int) -> tuple[str, list[dict]]:
    """Feed ``text`` in pieces of ``size`` characters; merge the deltas as a client does."""
    stream = tools.stream()
    content, calls = "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] + [None]
    for piece in pieces:
        more, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += more
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["id"].startswith("call_")
                calls.append({"name": delta["function"]["name"], "arguments": ""})
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


def whole(tools: ToolCalling, text: str, finish_reason: str = "stop"):
    message, reason = tools.message(text, finish_reason)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return message["content"], calls, reason


TAGGED_NO_CALL = "Hi <|tool_call_start|>[1]<|tool_call_end|> x <|python_start|>[2]<|python_end|>"
CASES = {
    # name: (tool_choice, text, content, calls)
    "named": ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Pa}r\\"is"}', None,
              [("get_weather", '{"city": "Pa}r\\"is"}')]),
    "required-two": ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                 '{"name": "get_time", "parameters": {}}]', None,
                     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "hermes": ("auto", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                       '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Sure.\n\n",
               [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "hermes-unclosed-at-the-end": ("auto", '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}', None,
                                   [("get_time", '{"city": "Rome"}')]),
    "hermes-bad-json-stays-content": ("auto", "a <tool_ca b <tool_call>bad</tool_call> c",
                                      "a <tool_ca b <tool_call>bad</tool_call> c", []),
    "hermes-no-call": ("auto", "The weather is fine.", "The weather is fine.", []),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole_response(name, size):
    tool_choice, text, content, calls = CASES[name]
    tools = calling(tool_choice)
    expected_calls = [{"name": n, "arguments": a} for n, a in calls]
    got_content, got_calls, reason = whole(tools, text)
    assert (got_content, got_calls) == (content, expected_calls)
    assert reason == ("tool_calls" if calls else "stop")
    streamed_content, streamed_calls = streamed(tools, text, size)
    assert streamed_calls == expected_calls and streamed_content == (content or "")


PARSER_CASES = {
    # name: (parser, text, content, calls); arguments as the model wrote them (JSON formats) or as JSON made of
    # the parameters (XML format)
    "hermes-qwen3-style": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                     '</tool_call>', None, [("get_weather", '{"city": "Paris"}')]),
    "hermes-arguments-as-text": ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": 1}"}</tool_call>',
                                 None, [("get_time", '{"tz": 1}')]),
    "llama3-json": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                    [("get_weather", '{"city": "Paris"}')]),
    "llama3-json-python-tag-two-calls": (
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                       '{"name": "get_time", "parameters": {}}', None,
        [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]),
    "llama3-json-text": ("llama3_json", "Paris is sunny {not a call}", "Paris is sunny {not a call}", []),
    "mistral-array": ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                                 '"Paris"}}, {"name": "get_time", "arguments": {}}]', "Let me check. ",
                      [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "mistral-named": ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}', None,
                      [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    "mistral-text": ("mistral", "No tools needed [really].", "No tools needed [really].", []),
    "pythonic": ("pythonic", '[get_weather(city="Paris", days=3), get_time()]', None,
                 [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    "pythonic-llama4-tags": ("pythonic", "<|python_start|>[get_time(tz='UTC')]<|python_end|>", None,
                             [("get_time", '{"tz": "UTC"}')]),
    "pythonic-text": ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    "pythonic-lfm2": ("pythonic", 'Let me look. <|tool_call_start|>[get_weather(city="Paris"), get_time()]'
                                  "<|tool_call_end|>Checking both.", "Let me look. Checking both.",
                      [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "pythonic-lfm2-twice": ("pythonic", "<|tool_call_start|>[get_time(tz='<|tool_call_end|>')]<|tool_call_end|>"
                                        "then <|tool_call_start|>[get_time()]<|tool_call_end|>", "then ",
                            [("get_time", '{"tz": "<|tool_call_end|>"}'), ("get_time", "{}")]),
    "pythonic-not-a-tool": ("pythonic", "[Source(Wikipedia)] Paris is the capital.",
                            "[Source(Wikipedia)] Paris is the capital.", []),
    "pythonic-tagged-no-call": ("pythonic", TAGGED_NO_CALL, TAGGED_NO_CALL, []),
    "pythonic-unbalanced": ("pythonic", "[get_weather(city='Oslo']) done", " done",
                            [("get_weather", '{"city": "Oslo"}')]),
    "pythonic-space-before-tag": ("pythonic", " <|python_start|>hello", " <|python_start|>hello", []),
    "pythonic-lfm2-no-list": ("pythonic", "<|tool_call_start|> none [x] <|im", "<|tool_call_start|> none [x] <|im",
                              []),
    "qwen3-xml": ("qwen3_xml", "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                               "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
                  "I will look.\n", [("get_weather", '{"city": "Paris", "days": 3}')]),
    "qwen3-coder-string-typed": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n"
                                                "</parameter>\n</function>\n</tool_call>", None,
                                 [("get_weather", '{"city": "42"}')]),  # the schema says string
    "qwen3-xml-not-a-call": ("qwen3_xml", "<tool_call>oops</tool_call> done", "<tool_call>oops</tool_call> done", []),
}


@pytest.mark.parametrize("name", PARSER_CASES)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_every_parser_streams_what_the_whole_response_says(name, size):
    parser, text, content, calls = PARSER_CASES[name]
    tools = calling("auto", parser)
    expected_calls = [{"name": n, "arguments": a} for n, a in calls]
    got_content, got_calls, reason = whole(tools, text)
    assert (got_content, got_calls) == (content, expected_calls)
    assert reason == ("tool_calls" if calls else "stop")
    assert streamed(tools, text, size) == ((content or ""), expected_calls)
    for call in expected_calls:
        json.loads(call["arguments"])


def test_arguments_stream_as_they_are_written():
    """A client sees a JSON call's arguments grow token by token, not at the end of the call."""
    stream = calling("auto", "hermes").stream()
    _, deltas = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""}, {"arguments": '{"ci'}]
    _, deltas = stream.feed('ty": "Pa')
    assert deltas == [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]


def test_pythonic_arguments_stream_one_keyword_at_a_time():
    """A pythonic call's name goes out at its parenthesis, each argument once its value is written: a value that is
    not a literal as its source text, a call cut off by the length limit as the arguments it had."""
    stream = calling("auto", "pythonic").stream()
    _, deltas = stream.feed("[get_weather(")
    assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""}]
    _, deltas = stream.feed('city="Paris, FR", days=')
    assert deltas == [{"index": 0, "function": {"arguments": '{"city": "Paris, FR"'}}]
    _, deltas = stream.feed("3, when=today, ")
    assert [d["function"]["arguments"] for d in deltas] == [', "days": 3', ', "when": "today"']
    _, deltas = stream.feed('units={"t": "C"}), get_time(tz="U')
    assert [d["function"]["arguments"] for d in deltas] == [', "units": {"t": "C"}', "}", ""]
    assert deltas[2]["function"]["name"] == "get_time"
    assert stream.finish() == ("", [{"index": 1, "function": {"arguments": "{}"}}])


def test_a_tool_call_nested_past_the_json_parser_is_read_without_recursion():
    """Nesting deeper than Python's JSON parser takes (it would raise RecursionError) is scanned, not parsed: the
    arguments stream as written, whole or streamed alike."""
    arguments = "[" * 100_000 + "]" * 100_000
    text = '<tool_call>{"name": "get_time", "arguments": ' + arguments + "}</tool_call>"
    tools = calling("auto")
    assert whole(tools, text) == (None, [{"name": "get_time", "arguments": arguments}], "tool_calls")
    assert streamed(tools, text, 4096) == ("", [{"name": "get_time", "arguments": arguments}])


def test_cut_by_max_tokens():
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    assert whole(named, '{"ci', "length") == (None, [{"name": "get_weather", "arguments": '{"ci'}], "length")
    required = calling("required")
    cut_in_arguments = '[{"name": "get_weather", "parameters": {"ci'
    assert whole(required, cut_in_arguments, "length")[1:] == ([{"name": "get_weather", "arguments": '{"ci'}],
                                                               "length")
    assert whole(required, '[{"name": "get_w', "length") == ('[{"name": "get_w', [], "length")


def test_what_each_tool_choice_asks_for():
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    assert named.constraint() == StructuredOutputsParams(json=WEATHER)
    schema = json.loads(calling("required").constraint().key()[1])
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert json.loads(calling("required", parallel_tool_calls=False).constraint().key()[1])["maxItems"] == 1
    assert calling("auto").constraint() is None
    assert calling("none") is None and ToolCalling.for_request(chat_request(), None) is None
    fields = named.template_fields(chat_request(tools=TOOLS, chat_template_kwargs={"x": 1}))
    assert fields.chat_template_kwargs["x"] == 1 and [t["function"]["name"] for t in
                                                      fields.chat_template_kwargs["tools"]] == ["get_weather",
                                                                                                "get_time"]


@pytest.mark.parametrize("tool_choice, parser, message", [
    (None, None, "--enable-auto-tool-choice --tool-call-parser NAME"),  # auto by default
    ("auto", None, "--enable-auto-tool-choice"),
    ({"type": "function", "function": {"name": "nope"}}, "hermes", "'nope', which is not among the tools"),
])
def test_tool_choices_refused(tool_choice, parser, message):
    with pytest.raises(OpenAIError, match=message) as info:
        calling(tool_choice, parser)
    assert info.value.status == 400 and info.value.param == "tool_choice"


def test_tool_choice_without_tools_is_refused():
    with pytest.raises(OpenAIError, match="tool_choice needs tools"):
        ToolCalling.for_request(chat_request(tool_choice="required"), "hermes")


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "text"}}, (None, None)),
    ({"response_format": {"type": "json_object"}}, (StructuredOutputsParams(json_object=True), "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
     (StructuredOutputsParams(json=WEATHER), "response_format")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, (StructuredOutputsParams(choice=["a", "b"]),
                                                      "structured_outputs")),
    ({"guided_json": json.dumps(WEATHER)}, (StructuredOutputsParams(json=json.dumps(WEATHER)), "guided_json")),
    ({"guided_grammar": 'root ::= "a"'}, (StructuredOutputsParams(grammar='root ::= "a"'), "guided_grammar")),
])
def test_request_fields_map_to_one_constraint(fields, expected):
    assert CompletionRequest.model_validate({"prompt": "x", **fields}).structured_outputs_params() == expected


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one output constraint, not several: response_format, guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
])
def test_bad_request_fields(fields, param, message):
    with pytest.raises(OpenAIError, match=message) as info:
        CompletionRequest.model_validate({"prompt": "x", **fields}).structured_outputs_params()
    assert info.value.param == param


def test_the_parsers_the_cli_offers_are_the_ones_there_are():
    from pagedllm.entrypoints.openai.cli_args import TOOL_CALL_PARSERS
    from pagedllm.entrypoints.openai.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
