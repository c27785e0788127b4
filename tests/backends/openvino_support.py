"""Shared pieces of the openvino backend tests: availability, an export cache for the tiny models, teacher forcing."""

from __future__ import annotations

import pytest
from equality_support import one_sequence_batch, teacher_forced_top1  # noqa: F401  (shared with the cpu tests)

from pagedllm.backends.openvino.backend import OpenVINOBackend

AVAILABLE, WHY_NOT = OpenVINOBackend.is_available()
requires_openvino = pytest.mark.skipif(not AVAILABLE, reason=f"openvino backend unavailable: {WHY_NOT}")


@pytest.fixture(scope="module")
def tiny_export_cache(openvino_export_dir):
    """PAGEDLLM_CACHE_DIR set to the session's export folder for a whole module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(openvino_export_dir))
        yield openvino_export_dir
