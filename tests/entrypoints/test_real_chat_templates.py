"""The tool-call and reasoning parsers against real models' chat templates: those optimum-intel ships (Qwen3 with
hermes-style calls and thinking, Mistral's [TOOL_CALLS], DeepSeek-R1's thinking), read from the installed package,
and those kept in chat_templates/ as the models publish them (Llama 3.2's JSON calls, Qwen3-Coder's XML calls,
LFM2's pythonic calls).

What a template writes for an assistant turn is what the model was trained to generate: each turn is rendered, its
text after the prompt is parsed back, and the calls (or reasoning) must be the ones that went in. History arguments
sent as JSON text, as OpenAI's clients send them, must reach the template as objects.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedllm.engine.input_processing import render_chat
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import split_reasoning
from pagedllm.entrypoints.openai.tool_calls import ToolCalling

templates = pytest.importorskip("optimum.exporters.openvino.utils").COMPLEX_CHAT_TEMPLATES
TEMPLATE_FILES = Path(__file__).parent / "chat_templates"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}},
                                                           "required": ["city"]}}}
USER = {"role": "user", "content": "What is the weather in Paris for 3 days?"}
CALL = {"id": "call00001", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}


def template(*marks: str) -> str:
    return next(t for t in templates if all(m in t for m in marks))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def generated_part(tokenizer, chat_template: str, turn: dict, end: str, **kwargs) -> str:
    """The assistant turn as the template writes it: the text after the generation prompt, up to its end token."""
    prompt = render_chat(tokenizer, [USER], chat_template, True, tools=[WEATHER], **kwargs)["prompt"]
    whole = render_chat(tokenizer, [USER, turn], chat_template, False, tools=[WEATHER], **kwargs)["prompt"]
    assert whole.startswith(prompt)
    return whole[len(prompt):].split(end)[0]


def parsed_calls(parser: str, text: str) -> tuple[str | None, list[dict]]:
    request = ChatCompletionRequest.model_validate({"messages": [USER], "tools": [WEATHER]})
    tools = ToolCalling.for_request(request, parser)
    message, _ = tools.message(text, "stop")
    return message["content"], [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                                for c in message.get("tool_calls", [])]


EXPECTED = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]


def test_qwen3_tool_calls_and_thinking_round_trip(tokenizer):
    chat_template = template("enable_thinking", "<tool_call>")
    turn = {"role": "assistant", "content": "", "reasoning_content": "The user wants weather.",
            "tool_calls": [CALL]}
    text = generated_part(tokenizer, chat_template, turn, "<|im_end|>")
    reasoning, rest = split_reasoning("qwen3", text)
    assert reasoning.strip() == "The user wants weather."
    assert parsed_calls("hermes", rest)[1] == EXPECTED
    # thinking turned off in the template: the output starts past an empty think block, and is content
    prompt = render_chat(tokenizer, [USER], chat_template, True, enable_thinking=False)["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_mistral_tool_calls_round_trip(tokenizer):
    chat_template = template("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")
    turn = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    text = generated_part(tokenizer, chat_template, turn, tokenizer.eos_token)
    assert text.startswith("[TOOL_CALLS] [")
    # the arguments went in as objects: written as JSON, not as a string of JSON
    assert '"arguments": {"city": "Paris", "days": 3}' in text
    assert parsed_calls("mistral", text) == (None, EXPECTED)


def test_deepseek_r1_opens_the_thinking_in_the_prompt(tokenizer):
    chat_template = template("<think>", "tool▁outputs▁end")
    prompt = render_chat(tokenizer, [USER], chat_template, True)["prompt"]
    assert prompt.endswith("<think>\n")  # what the deepseek_r1 parser assumes: output begins inside the reasoning
    assert split_reasoning("deepseek_r1", "Paris, 3 days: look it up.\n</think>\n\nSunny.") == \
        ("Paris, 3 days: look it up.\n", "Sunny.")
    history = [USER, {"role": "assistant", "content": "<think>old thoughts</think>Sunny."}, USER]
    assert "old thoughts" not in render_chat(tokenizer, history, chat_template, True)["prompt"]


def test_llama_3_2_json_tool_calls_round_trip(tokenizer):
    chat_template = (TEMPLATE_FILES / "Llama-3.2-Instruct.jinja").read_text()
    turn = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    text = generated_part(tokenizer, chat_template, turn, "<|eot_id|>")
    assert text == '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    assert parsed_calls("llama3_json", text) == (None, EXPECTED)


def test_qwen3_coder_xml_tool_calls_round_trip(tokenizer):
    chat_template = (TEMPLATE_FILES / "Qwen3-Coder.jinja").read_text()
    turn = {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}
    text = generated_part(tokenizer, chat_template, turn, "<|im_end|>")
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    content, calls = parsed_calls("qwen3_xml", text)
    assert content.strip() == "Let me look." and calls == EXPECTED  # days typed by the tool's schema


def test_lfm2_pythonic_tool_calls_round_trip(tokenizer):
    """LFM2 lists the tools in its system turn and writes its calls as a Python list between its tool-call tags, in
    the content (its template renders no ``tool_calls`` field): the ``pythonic`` parser reads them back."""
    chat_template = (TEMPLATE_FILES / "LFM2.jinja").read_text()
    prompt = render_chat(tokenizer, [USER], chat_template, True, tools=[WEATHER])["prompt"]
    assert f"List of tools: <|tool_list_start|>[{json.dumps(WEATHER)}]<|tool_list_end|>" in prompt
    written = '<|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>Checking the weather.'
    text = generated_part(tokenizer, chat_template, {"role": "assistant", "content": written}, "<|im_end|>")
    assert parsed_calls("pythonic", text) == ("Checking the weather.", EXPECTED)
    tool_turn = render_chat(tokenizer, [USER, {"role": "assistant", "content": written},
                                        {"role": "tool", "content": "Sunny"}], chat_template, True)["prompt"]
    assert tool_turn.endswith("<|im_start|>tool\n<|tool_response_start|>Sunny<|tool_response_end|><|im_end|>\n"
                              "<|im_start|>assistant\n")
