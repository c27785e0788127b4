"""`pagedllm serve --enable-lora --lora-modules a=... b=...`: the openai client picks each adapter by name beside the
base model (answers equal the offline engine's with the same adapter), /v1/models lists them, and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True adapters are added and removed while serving."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from lora_adapters import make_adapter

from pagedllm import LLM, LoRARequest, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    return {"a": make_adapter(tiny_llama_dir, root / "a", seed=1),
            "b": make_adapter(tiny_llama_dir, root / "b", seed=2, rank=4, targets=("q_proj", "v_proj"))}


def test_adapters_by_name_through_the_openai_client(start_server, tiny_llama_dir, adapters):
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2, kv_cache_space=0.01)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = {name: llm.generate([PROMPT], params, use_tqdm=False,
                                  lora_request=LoRARequest(name, i + 1, str(path)))[0].outputs[0].text
               for i, (name, path) in enumerate(adapters.items())}
    offline["tiny"] = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()

    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-space",
                          "0.01", "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
                          "--lora-modules", f"a={adapters['a']}", f'{{"name": "b", "path": "{adapters["b"]}"}}',
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a", "b"} and models["a"].parent == "tiny" and "/" not in models["a"].root

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert {name: complete(name) for name in ("a", "tiny", "b")} == offline
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "b" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="'c' does not exist"):
        complete("c")

    load = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["a"])})
    assert load.status_code == 200 and "added" in load.text
    assert complete("c") == offline["a"]
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete("c")
    assert server.wait_idle()["pagedllm:requests_tracked[front_end]"] == 0


def test_runtime_updates_are_off_unless_allowed_and_modules_need_enable_lora(start_server, tiny_llama_dir,
                                                                           adapters):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-space",
                          "0.01", "--enable-lora", "--lora-modules", f"a={adapters['a']}")
    assert httpx.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "c", "lora_path": str(adapters["a"])}).status_code == 404
    refused = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama_dir),
                              "--lora-modules", f"a={adapters['a']}"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--lora-modules needs --enable-lora" in refused.stderr
