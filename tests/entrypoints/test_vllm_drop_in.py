"""What a user coming from vLLM types works as it does there: a model by Hub id from a Hub cache laid out on disk
(no network), ``--model`` on every command, vLLM's flags (``--config`` YAML, human-readable sizes, CORS, TLS,
several API keys, GPU-only flags accepted with a warning), and the model's generation_config.json defaults."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from hub_cache import COMMIT, OFFLINE, hub_cache

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.config_file import expand_config_file
from pagedllm.errors import ConfigError, ModelNotFoundError
from pagedllm.models.source import resolve_model

REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def cache(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    hub_cache(root, REPO, tiny_llama_dir.iterdir())
    return root


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_hub_id_resolves_to_its_cached_snapshot(cache, tiny_llama_dir, tmp_path):
    source = resolve_model(REPO, download_dir=str(cache))
    assert source.name == REPO and source.kind == "hf" and source.path.name == COMMIT
    assert resolve_model(REPO, revision=COMMIT, download_dir=str(cache)).path == source.path
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model("tiny-org/missing", download_dir=str(cache))
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model(REPO, revision="v9", download_dir=str(cache))
    with pytest.raises(ModelNotFoundError, match="or a Hub id"):
        resolve_model("not a path or id")
    # one GGUF file of a repository, as vLLM's repo:file
    gguf_repo = hub_cache(tmp_path, "org/gguf", [])
    (gguf_repo / "model.Q8_0.gguf").write_bytes(b"GGUF")
    from pagedllm.models import source as source_module

    assert source_module._local_path("org/gguf:model.Q8_0.gguf", None, str(tmp_path), "model") == \
        gguf_repo / "model.Q8_0.gguf"


def test_a_gguf_file_of_a_repository_by_quantization_type(tmp_path):
    """vLLM's and llama.cpp's ``org/name:Q4_K_M``: the one file named for that type, from the cache when offline."""
    from pagedllm.models import source as source_module

    repo = hub_cache(tmp_path, "org/gguf", [])
    names = ["model-Q4_K_M.gguf", "model.Q8_0.gguf", "model-UD-Q4_K_XL.gguf", "model-Q4_K_XL-v2.gguf",
             "big/model-Q6_K-00001-of-00002.gguf", "big/model-Q6_K-00002-of-00002.gguf", "README.md"]
    for name in names:
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_bytes(b"GGUF")

    def resolve(name):
        return source_module._local_path(name, None, str(tmp_path), "model")

    assert resolve("org/gguf:Q4_K_M") == repo / "model-Q4_K_M.gguf"
    assert resolve("org/gguf:q8_0") == repo / "model.Q8_0.gguf"  # any case, after '-' or '.'
    assert resolve("org/gguf:UD-Q4_K_XL") == repo / "model-UD-Q4_K_XL.gguf"
    with pytest.raises(ModelNotFoundError, match="split into 2 files .*llama-gguf-split --merge"):
        resolve("org/gguf:Q6_K")
    with pytest.raises(ModelNotFoundError, match="no .gguf files of type Q5_K_M; its .gguf files: big/model"):
        resolve("org/gguf:Q5_K_M")
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve("org/missing:Q4_K_M")


def test_a_quantization_type_without_a_connection_is_found_in_the_cache(tmp_path, monkeypatch):
    """Online but unable to reach the Hub: the cached snapshot's files, as hf_hub_download falls back to them."""
    import httpx
    import huggingface_hub
    from huggingface_hub import constants

    from pagedllm.models import source as source_module

    repo = hub_cache(tmp_path, "org/gguf", [])
    (repo / "model-Q4_K_M.gguf").write_bytes(b"GGUF")

    def unreachable(*args, **kwargs):
        raise httpx.ConnectError("no route to the Hub")

    download = huggingface_hub.hf_hub_download
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *args, **kwargs: download(*args, **kwargs, local_files_only=True))
    assert source_module._local_path("org/gguf:Q4_K_M", None, str(tmp_path), "model") == repo / "model-Q4_K_M.gguf"


def test_llm_by_hub_id_and_quantization_type_runs_that_file(tmp_path):
    """The default model's file in a Hub cache (a link to the blob, as huggingface_hub keeps files), named
    ``org/name:Q4_1``: the same greedy tokens as by its path."""
    from pagedllm.models.source import default_model_path

    gguf = default_model_path()
    (hub_cache(tmp_path, "org/smollm2-gguf", []) / gguf.name).symlink_to(gguf)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for model in ("org/smollm2-gguf:Q4_1", str(gguf)):
        llm = LLM(model, download_dir=str(tmp_path), max_model_len=256, kv_cache_space=0.1)
        outputs.append(llm.generate(["Tell me about Paris"], params, use_tqdm=False)[0].outputs[0].token_ids)
        llm.shutdown()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


def test_a_cache_missing_a_shard_is_refused_naming_it(tiny_llama_dir, tmp_path):
    snapshot = hub_cache(tmp_path, REPO, tiny_llama_dir.iterdir())
    (snapshot / "model.safetensors").rename(snapshot / "model-00001-of-00002.safetensors")
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        resolve_model(REPO, download_dir=str(tmp_path))
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="no weights"):
        resolve_model(REPO, download_dir=str(tmp_path))


def test_llm_by_hub_id_equals_the_folder(cache, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_id = LLM(REPO, download_dir=str(cache), dtype="float32", kv_cache_space=0.01, trust_remote_code=True)
    assert by_id.get_tokenizer() is by_id.tokenizer
    text = by_id.generate("Paris is", params, use_tqdm=False)[0].text
    by_id.shutdown()
    local = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space=0.01)
    assert text == local.generate("Paris is", params, use_tqdm=False)[0].text
    local.shutdown()


def test_serve_model_flag_from_the_hub_cache_with_vllm_flags(cache, start_server, tmp_path):
    """vLLM's serve command line, flag for flag, with the model named by Hub id and found in HF_HUB_CACHE."""
    config = tmp_path / "config.yaml"
    config.write_text("max_model_len: 0.5K\nenable_prefix_caching: true\nmax-logprobs: 5\n")
    server = start_server("--model", REPO, "--config", str(config), "--dtype", "float32", "--kv-cache-space",
                          "0.01", "--trust-remote-code", "--generation-config", "auto", "--uvicorn-log-level",
                          "warning", "--root-path", "/proxy", "--allowed-origins", '["http://ui.example"]',
                          "--api-key", "k1,k2", "--gpu-memory-utilization", "0.9", "--enforce-eager",
                          "--swap-space", "4", "--disable-log-stats", "--scheduling-policy", "priority",
                          "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                          env={**OFFLINE, "HF_HUB_CACHE": str(cache), "PAGEDLLM_LOGGING_LEVEL": "INFO"})
    log = server.log()
    assert "--gpu-memory-utilization has no effect" in log and "--enforce-eager has no effect" in log
    for key in ("k1", "k2"):
        with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            models = client.models.list().data
            assert [m.id for m in models] == [REPO] and models[0].model_extra["max_model_len"] == 512
            out = client.completions.create(model=REPO, prompt="Paris is", max_tokens=3, logprobs=5,
                                            extra_body={"priority": -5})
            assert out.usage.prompt_tokens_details.cached_tokens == 0
            with pytest.raises(openai.BadRequestError):  # --max-logprobs 5, from the YAML file
                client.completions.create(model=REPO, prompt="x", logprobs=6)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="k1", max_retries=0) as client:  # a prompt repeating
        client.completions.create(model=REPO, prompt="Paris is the capital. Paris is the capital. Paris is the",
                                  max_tokens=48, temperature=0)
    assert server.metrics()["vllm:spec_decode_num_draft_tokens_total"] > 0
    # uvicorn puts --root-path in front of the path the middleware sees: the key still guards /v1
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401
    assert httpx.get(server.url + "/ping").status_code == 200
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    assert httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}).status_code == 400


def test_serve_over_tls(tiny_llama_dir, start_server, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.01", "--ssl-keyfile",
                          str(key), "--ssl-certfile", str(cert), scheme="https", verify=str(cert))
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "Paris", "max_tokens": 2},
                          verify=str(cert))
    assert server.url.startswith("https://") and response.status_code == 200


def test_generation_config_defaults_apply_where_the_request_leaves_them_out(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 0.7, "eos_token_id": 0}))
    llm = LLM(str(model), dtype="float32", kv_cache_space=0.01)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature) == (1, 0.7)
    greedy = llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].text
    defaults.max_tokens, defaults.ignore_eos = 12, True
    assert llm.generate("Paris is", use_tqdm=False)[0].text == greedy  # top_k 1: the likeliest token each time
    llm.shutdown()


def test_model_flag_and_positional_model_are_one():
    parser = build_parser()
    from pagedllm.entrypoints.openai.cli_args import merge_model_args

    for argv in (["serve", "m"], ["serve", "--model", "m"], ["serve", "m", "--model", "m"]):
        args = parser.parse_args(argv)
        merge_model_args(args)
        assert args.model == "m"
    args = parser.parse_args(["serve", "a", "--model", "b"])
    with pytest.raises(ConfigError, match="two models given"):
        merge_model_args(args)
    for command in ("generate", "bench throughput"):
        assert parser.parse_args([*command.split(), "--model", "m"]).model == "m"


@pytest.mark.parametrize("value, expected", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 1 << 20),
                                             ("4096", 4096)])
def test_human_readable_sizes(value, expected):
    assert build_parser().parse_args(["generate", "--max-model-len", value]).max_model_len == expected


def test_config_file_flags_lose_to_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9000\nmax_model_len: 2k\nenable-prefix-caching: false\nserved_model_name: [a, b]\n"
                      "speculative-config: {method: ngram, num_speculative_tokens: 4}\nallowed-origins: ['*']\n")
    parser = build_parser()
    args = parser.parse_args(expand_config_file(["serve", "m", "--config", str(config), "--port", "9100"], parser))
    assert (args.port, args.max_model_len, args.enable_prefix_caching, args.served_model_name) == \
        (9100, 2000, False, ["a", "b"])
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert args.allowed_origins == ["*"]
    config.write_text("no_such_flag: 1\n")
    with pytest.raises(ConfigError, match="not a flag of this command"):
        expand_config_file(["serve", "--config", str(config)], parser)
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2


def test_offline_missing_model_is_a_clear_cli_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "generate", "--model",
                             "tiny-org/not-here", "--download-dir", str(tmp_path), "hi"],
                            capture_output=True, text=True, env={**__import__("os").environ, **OFFLINE}, timeout=120)
    assert result.returncode == 2 and "not in the Hugging Face cache" in result.stderr
    assert "Traceback" not in result.stderr


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}("
    "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }}{% endfor %}){% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ note or '' }}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_llm_chat_takes_tools_template_kwargs_and_continues_the_final_message(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space=0.01)
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    prompt = llm.apply_chat_template(history, TOOLS_TEMPLATE, tools=[WEATHER],
                                     chat_template_kwargs={"note": "NOTE"})["prompt"]
    # the call's arguments reached the template as an object (OpenAI's clients send them as JSON text)
    assert prompt.startswith("TOOLS:get_weather") and "CALL get_weather(city=Paris)" in prompt
    assert prompt.endswith("assistant:NOTE")
    draft = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello"}]
    assert llm.apply_chat_template(draft, TOOLS_TEMPLATE, continue_final_message=True)["prompt"].endswith("Hello")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.chat(draft, params, chat_template=TOOLS_TEMPLATE, continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith("Hello") and len(out.token_ids) == 4
    llm.shutdown()


def test_async_llm_generate_and_abort(tiny_llama_dir):
    import asyncio

    from pagedllm import AsyncEngineArgs, AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    local = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_space=0.01)
    expected = local.generate("Paris is", params, use_tqdm=False)[0].text
    local.shutdown()

    async def run(engine) -> None:
        outputs = [output async for output in engine.generate("Paris is", params, request_id="a")]
        assert outputs[-1].finished and outputs[-1].outputs[0].text == expected
        # cumulative, a token more each step, each output a snapshot however late the caller reads it
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 9))
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        async for output in engine.generate("Paris is", long, request_id="b"):
            if len(output.outputs[0].token_ids) == 2:
                await engine.abort("b")
                break
        for _ in range(100):
            if engine.engine.requests_tracked == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.engine.requests_tracked == 0 and not engine.errored
        assert (await engine.get_tokenizer()).decode([5]) == local.tokenizer.decode([5])

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(tiny_llama_dir), dtype="float32",
                                                       kv_cache_space=0.01))
    try:
        asyncio.run(run(engine))
    finally:
        engine.shutdown()
