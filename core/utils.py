"""Small helpers every layer may use; part of the backend contract (imports nothing)."""

from __future__ import annotations

import gc
import logging
import sys


def cdiv(a: int, b: int) -> int:
    """The ceiling of a / b for positive b: how many b-sized blocks hold a items."""
    return -(a // -b)


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` in this interpreter, without the working directory on ``sys.path``: a file there
    named like a module the child imports would otherwise be run in its place (``-P``, or by hand before 3.11)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    code = (f"import runpy, sys; del sys.path[0]; sys.argv[0] = {module!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", code, *args]


def skip_unused_sklearn_import() -> None:
    """Keep transformers' model classes from importing scikit-learn, which nncf (the openvino backend's weight
    compressor) installs: transformers uses it only for assisted generation's adaptive confidence threshold, which
    pagedllm never runs, and the import is a large share of every start-up. Call before the model classes are first
    imported; later calls do nothing."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return
    import transformers.utils

    available = transformers.utils.is_sklearn_available
    transformers.utils.is_sklearn_available = lambda: False
    try:
        import transformers.generation.candidate_generator  # noqa: F401  (the one module that keeps the answer)
    finally:
        transformers.utils.is_sklearn_available = available


def freeze_startup_heap() -> None:
    """For a process that lives as long as its engine: move what start-up made (modules, the model's Python objects)
    out of the cyclic collector's reach, so that later full collections skip them, and so does the one at exit,
    which otherwise holds a stopping server for seconds. Garbage is collected first; what is frozen is never freed,
    hence not for ``LLM`` in a caller's process, where engines come and go."""
    gc.collect()
    gc.freeze()
    logging.getLogger("pagedllm").debug("start-up heap frozen: %d objects", gc.get_freeze_count())
