"""`pagedllm serve` with no MODEL serves the default model (SmolLM2-135M-Instruct) with its own chat template."""

import openai
import pytest

from pagedllm.models.source import DEFAULT_MODEL_NAME


@pytest.mark.slow
def test_serve_without_a_model_answers_a_chat(start_server):
    server = start_server("--dtype", "float32", "--max-model-len", "1024", "--kv-cache-space", "0.1")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
        out = client.chat.completions.create(model=DEFAULT_MODEL_NAME, max_tokens=24, temperature=0,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
    reply = out.choices[0].message.content
    assert "Paris" in reply and out.usage.completion_tokens <= 24
