"""What every backend's equality tests share: the prompts, the transformers references, greedy settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tiny_models import hf_greedy, random_prompts

from pagedllm import Batch, SamplingParams
from pagedllm.utils import cdiv

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


def one_sequence_batch(token_ids: list[int], logits_indices, block_ids=None, block_size: int = 32) -> Batch:
    """A prefill of ``token_ids`` as one sequence, in blocks 0, 1, ... unless ``block_ids`` are given."""
    n = len(token_ids)
    if block_ids is None:
        block_ids = list(range(cdiv(n, block_size)))
    positions = np.arange(n, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)[np.minimum(positions // block_size, len(block_ids) - 1)]
    return Batch(
        input_ids=np.asarray(token_ids, dtype=np.int64), positions=positions,
        query_start_loc=np.array([0, n], dtype=np.int32), num_computed=np.zeros(1, dtype=np.int32),
        seq_lens=np.array([n], dtype=np.int32), block_table=np.asarray([block_ids], dtype=np.int32),
        slot_mapping=blocks * block_size + positions % block_size,
        logits_indices=np.asarray(logits_indices, dtype=np.int64), num_decodes=0, block_size=block_size)


def teacher_forced_top1(llm, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """The model's top token at each step of ``continuation``, given the exact tokens before it (idle engine).
    Unlike free-running greedy agreement, one early difference does not count against every later step."""
    ids = prompt + continuation
    batch = one_sequence_batch(ids, np.arange(len(prompt) - 1, len(ids) - 1), block_size=llm.engine.config.block_size)
    return np.asarray(llm.engine.backend.execute(batch)).argmax(-1)
