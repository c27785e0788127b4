"""Shared pieces of the openvino backend tests: availability, an export cache for the tiny models, teacher forcing."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import Batch
from pagedllm.backends.openvino.backend import OpenVINOBackend

AVAILABLE, WHY_NOT = OpenVINOBackend.is_available()
requires_openvino = pytest.mark.skipif(not AVAILABLE, reason=f"openvino backend unavailable: {WHY_NOT}")


@pytest.fixture(scope="module")
def tiny_export_cache(tmp_path_factory):
    """PAGEDLLM_CACHE_DIR for the tiny models' exports: one folder per session, shared by the test modules
    (the tiny models live in per-session folders, so their exports cannot outlive the session anyway)."""
    path = tmp_path_factory.getbasetemp() / "openvino-export-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(path))
        yield path


def one_sequence_batch(token_ids: list[int], logits_indices, block_ids=None, block_size: int = 32) -> Batch:
    """A prefill of ``token_ids`` as one sequence, in blocks 0, 1, ... unless ``block_ids`` are given."""
    n = len(token_ids)
    if block_ids is None:
        block_ids = list(range(-(-n // block_size)))
    return Batch(
        input_ids=np.asarray(token_ids, dtype=np.int64), positions=np.arange(n, dtype=np.int64),
        query_start_loc=np.array([0, n], dtype=np.int32), num_computed=np.zeros(1, dtype=np.int32),
        seq_lens=np.array([n], dtype=np.int32), block_table=np.asarray([block_ids], dtype=np.int32),
        slot_mapping=np.zeros(n, dtype=np.int64), logits_indices=np.asarray(logits_indices, dtype=np.int64),
        num_decodes=0, block_size=block_size)


def teacher_forced_top1(llm, prompt: list[int], continuation: list[int]) -> np.ndarray:
    """The model's top token at each step of ``continuation``, given the exact tokens before it (idle engine)."""
    ids = prompt + continuation
    batch = one_sequence_batch(ids, np.arange(len(prompt) - 1, len(ids) - 1))
    return np.asarray(llm.engine.backend.execute(batch)).argmax(-1)
