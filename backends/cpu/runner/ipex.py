"""Whether intel-extension-for-pytorch can be used with the installed torch (it pins torch 2.8)."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=None)
def ipex_status() -> str:
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return "not installed (optional; IPEX 2.8 needs torch 2.8)"
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as exc:  # IPEX refuses a torch whose major.minor differs from its own
        return f"installed but not usable with torch {torch.__version__}: {exc}"
    return f"{ipex.__version__} importable, not used: pure torch kernels are used"
