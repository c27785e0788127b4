import pytest
import torch

from pagedllm.errors import InvalidRequestError
from pagedllm.request import Request
from pagedllm.sampling.sampler import Sampler
from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
])
def test_bad_parameters_are_refused_with_their_name(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_normalization():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0


def req(rid="r", **kwargs):
    return Request(rid, [1, 2, 3], SamplingParams(**kwargs))


def test_greedy_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    out = Sampler(0)(logits, [req(temperature=0), req(temperature=0)])
    assert out.token_ids == [1, 0]


def test_seeded_request_is_reproducible_regardless_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)

    def draws(batch_rows, seed_row, steps=5):
        sampler = Sampler(123)
        requests = [req(f"r{i}", temperature=1.0, seed=(7 if i == seed_row else None)) for i in range(batch_rows)]
        return [sampler(logits[:batch_rows], requests).token_ids[seed_row] for _ in range(steps)]

    alone = draws(1, 0)
    assert draws(4, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler(0)
    for _ in range(5):
        assert sampler(logits, [req(temperature=1, top_k=1)] * 3).token_ids == greedy
        assert sampler(logits, [req(temperature=1, top_p=1e-6)] * 3).token_ids == greedy
        assert sampler(logits, [req(temperature=1, min_p=1.0)] * 3).token_ids == greedy


def test_top_k_restricts_the_draw():
    logits = torch.tensor([[5.0, 4.9, 4.8, 4.7, -10.0, 0.0, 4.6]])
    allowed = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(0)
    seen = {sampler(logits, [req(temperature=2.0, top_k=3)]).token_ids[0] for _ in range(50)}
    assert seen <= allowed and len(seen) > 1


def test_logit_bias_and_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    assert Sampler(0)(logits.clone(), [req(temperature=0, logit_bias={0: 10})]).token_ids == [0]
    r = Request("m", [1], SamplingParams(temperature=0, min_tokens=2), stop_ids=frozenset({2}))
    assert Sampler(0)(logits.clone(), [r]).token_ids == [1]  # EOS (2) banned before min_tokens


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler(0)(logits, [req(temperature=0, logprobs=2)])
    sampled, rank, ids, values = out.logprobs[0]
    expected = torch.log_softmax(logits[0], -1)
    assert ids == [2, 1] and values == pytest.approx(expected[[2, 1]].tolist())
    assert sampled == pytest.approx(float(expected[2])) and rank == 1
    seeded = Sampler(0)(logits.expand(64, 3), [req(temperature=1.0, logprobs=0) for _ in range(64)]).logprobs
    assert {(round(lp, 5), rank) for lp, rank, _, _ in seeded} <= {(round(float(expected[t]), 5), 3 - t)
                                                                    for t in range(3)}  # rank 1 = the likeliest


def test_penalties_lower_repeated_tokens():
    logits = torch.tensor([[2.0, 2.0, 0.0]])
    r = Request("p", [5], SamplingParams(temperature=0, frequency_penalty=1.0))
    r.append_token(0)
    assert Sampler(0)(logits.clone(), [r]).token_ids == [1]
    r = Request("q", [0], SamplingParams(temperature=0, repetition_penalty=2.0))  # 0 is in the prompt
    assert Sampler(0)(logits.clone(), [r]).token_ids == [1]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**80])
def test_a_seed_past_64_bits_is_refused(seed):
    with pytest.raises(InvalidRequestError, match="seed must be an integer in") as info:
        SamplingParams(seed=seed)
    assert info.value.param == "seed"


def test_allowed_token_ids_and_bad_words():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert Sampler(0)(logits.clone(), [req(temperature=0, allowed_token_ids=[0, 1])]).token_ids == [1]
    r = req(temperature=0)
    r.bad_word_ids = [[3], [2, 1]]  # a one-token word, and a two-token one whose first token ends the output
    assert Sampler(0)(logits.clone(), [r]).token_ids == [2]
    r.append_token(2)
    assert Sampler(0)(torch.tensor([[0.0, 2.5, 2.0, 3.0]]), [r]).token_ids == [2]  # 1 would complete [2, 1]
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=["ok", ""])


def test_rejection_sampling_keeps_the_distribution_exact():
    """A proposed token verified against p: the first token out is distributed as p whatever was proposed, and
    after an accepted proposal the bonus token as the next row's distribution."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5], [2.0, 0.0, 0.0, 1.0]])
    p = torch.softmax(logits, dim=-1)
    sampler = Sampler(0)
    for proposal in (2, 0):
        request = req(temperature=1.0)
        firsts, bonus = torch.zeros(4), torch.zeros(4)
        trials = 20000
        for _ in range(trials):
            tokens, accepted = sampler.verify(logits, request, [proposal])
            firsts[tokens[0]] += 1
            if accepted:
                bonus[tokens[1]] += 1
        assert (firsts / trials - p[0]).abs().max() < 0.015
        assert (bonus / bonus.sum() - p[1]).abs().max() < 0.02
    greedy = req(temperature=0)
    assert sampler.verify(logits, greedy, [2]) == ([2, 0], 1) and sampler.verify(logits, greedy, [1]) == ([2], 0)
