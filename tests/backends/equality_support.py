"""What every backend's equality tests share: the prompts, the transformers references, greedy settings."""

from __future__ import annotations

from pathlib import Path

from tiny_models import hf_greedy, random_prompts
from pagedllm import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def build_references(model_dirs: dict[str, Path], architectures, lengths: list[int], prefix_len: int,
                     short_prefix_len: int) -> dict:
    """Per architecture: (prompts, transformers' greedy outputs) for independent prompts ("plain") and for
    prompts sharing a ``prefix_len`` prefix ("shared"; the last one is the prefix cut to ``short_prefix_len``)."""
    refs = {}
    for arch in architectures:
        plain = random_prompts(lengths, seed=1)
        prefix = random_prompts([prefix_len], seed=2)[0]
        shared = [prefix + suffix for suffix in random_prompts([3, 9, 16, 20], seed=3)] + [prefix[:short_prefix_len]]
        refs[arch] = {
            "plain": (plain, hf_greedy(model_dirs[arch], plain, NEW_TOKENS)),
            "shared": (shared, hf_greedy(model_dirs[arch], shared, NEW_TOKENS)),
        }
    return refs


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_outputs_depend_on_the_prompt(expected: list[list[int]]) -> None:
    """Guard against a vacuous oracle: the tiny models' outputs must vary with the prompt."""
    assert len({tuple(e) for e in expected}) == len(expected)
    assert all(len(set(e)) > 3 for e in expected)
