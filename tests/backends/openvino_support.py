"""Shared pieces of the openvino backend tests: availability, an export cache for the tiny models, teacher forcing."""

from __future__ import annotations

import pytest

from equality_support import one_sequence_batch, teacher_forced_top1  # noqa: F401  (shared with the cpu tests)
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
