"""Small helpers every layer may use; part of the backend contract (imports nothing)."""

from __future__ import annotations

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
