"""/v1/embeddings, /v1/score and /v1/rerank of ``pagedllm serve`` on all-MiniLM-L6-v2, through the ``openai``
client (which asks for base64 by default) and plain HTTP, equal to the offline engine's embeddings; what an
embedding server and a text server refuse of each other's endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from pagedllm import LLM
from pagedllm.models.source import default_embedding_model_path

TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]


@pytest.fixture(scope="module")
def offline() -> torch.Tensor:
    llm = LLM(str(default_embedding_model_path()), dtype="float32")
    vectors = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    llm.shutdown()
    return vectors


def test_embedding_endpoints_for_the_openai_client(start_server, offline):
    server = start_server("--runner", "pooling", "--dtype", "float32")  # the default embedding model
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    got = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire, decoded by the client
    assert [d.index for d in got.data] == [0, 1, 2] and got.usage.prompt_tokens > len(TEXTS)
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), offline, atol=1e-6, rtol=0)
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float", dimensions=32)
    assert len(floats.data[0].embedding) == 32
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = client.embeddings.create(model=model, input=[ids], encoding_format="float").data[0].embedding
    torch.testing.assert_close(torch.tensor(by_ids), offline[0], atol=1e-6, rtol=0)

    score = httpx.post(server.url + "/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    expected = torch.nn.functional.cosine_similarity(offline[0:1], offline[1:], dim=1)
    torch.testing.assert_close(torch.tensor([d["score"] for d in score["data"]]), expected, atol=1e-5, rtol=0)
    rerank = httpx.post(server.url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[2:0:-1],
                                                         "top_n": 1}).json()
    assert rerank["results"] == [{"index": 1, "document": {"text": TEXTS[1]},
                                  "relevance_score": pytest.approx(expected[0].item(), abs=1e-5)}]

    for path, body, param in (("/v1/embeddings", {"input": []}, "input"),
                              ("/v1/embeddings", {"input": "x", "dimensions": 1000}, "dimensions"),
                              ("/v1/embeddings", {"input": [[101] * 600]}, "input"),
                              ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, None)):
        answer = httpx.post(server.url + path, json=body)
        assert answer.status_code == 400, (path, answer.text)
        assert param is None or answer.json()["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_text_server_refuses_embeddings(start_server, tiny_llama_dir):
    server = start_server(str(tiny_llama_dir), "--dtype", "float32", "--kv-cache-space", "0.05")
    answer = httpx.post(server.url + "/v1/embeddings", json={"input": "Hi"})
    assert answer.status_code == 400 and "embedding model" in answer.json()["error"]["message"]
