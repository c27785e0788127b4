"""`pagedllm serve` settings: the chat template flag, the API key's env vars, values that make no sense."""

import pytest

from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.openai.cli_args import ServerConfig, load_chat_template
from pagedllm.errors import ConfigError

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_and_engine_flags():
    args = parse("./model", "--max-model-len", "256", "--enable-prefix-caching")
    config = ServerConfig.from_cli_args(args, environ={})
    assert (config.host, config.port, config.api_key, config.served_model_names) == ("127.0.0.1", 8000, None, None)
    assert (args.model_tag, args.max_model_len, args.enable_prefix_caching) == ("./model", 256, True)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_auto_tool_choice_needs_both_flags():
    assert ServerConfig.from_cli_args(parse(), environ={}).tool_call_parser is None
    assert ServerConfig.from_cli_args(parse("--tool-call-parser", "hermes"), environ={}).tool_call_parser is None
    both = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert ServerConfig.from_cli_args(both, environ={}).tool_call_parser == "hermes"


def test_api_key_flag_beats_env_vars():
    assert ServerConfig.from_cli_args(parse(), environ={"VLLM_API_KEY": "v"}).api_key == ["v"]
    assert ServerConfig.from_cli_args(parse(), environ={"VLLM_API_KEY": "v", "PAGEDLLM_API_KEY": "p"}).api_key == ["p"]
    assert ServerConfig.from_cli_args(parse("--api-key", "f,g"), environ={"PAGEDLLM_API_KEY": "p"}).api_key == \
        ["f", "g"]


@pytest.mark.parametrize("argv, message", [
    (["--max-request-size", "0"], "--max-request-size must be a positive number of bytes"),
    (["--max-log-len", "-1"], "--max-log-len must be 0 or more"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be 0 or more seconds"),
    (["--enable-auto-tool-choice"], r"--enable-auto-tool-choice needs --tool-call-parser \(hermes, llama3_json"),
])
def test_bad_values_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig.from_cli_args(parse(*argv), environ={})
