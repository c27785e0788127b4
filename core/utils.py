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


#: transformers' modules that import a package pagedllm never uses when told it is there, and the answer they keep.
_UNUSED_IMPORTS = {
    # scikit-learn (nncf installs it): assisted generation's adaptive confidence threshold
    "transformers.generation.candidate_generator": "is_sklearn_available",
    # scipy: the object-detection losses' matching, imported by every model class
    "transformers.loss.loss_utils": "is_scipy_available",
}


def skip_unused_imports() -> None:
    """Keep transformers' model classes from importing scikit-learn and scipy for features pagedllm never runs (see
    ``_UNUSED_IMPORTS``): the imports are a large share of every start-up. Call before the model classes are first
    imported; later calls do nothing, and transformers still answers the truth to anyone who asks afterwards."""
    if all(module in sys.modules for module in _UNUSED_IMPORTS):
        return
    import importlib

    import transformers.utils

    answers = {name: getattr(transformers.utils, name) for name in _UNUSED_IMPORTS.values()}
    for name in answers:
        setattr(transformers.utils, name, lambda: False)
    try:
        for module in _UNUSED_IMPORTS:  # each module keeps the answer it read
            importlib.import_module(module)
    finally:
        for name, answer in answers.items():
            setattr(transformers.utils, name, answer)


def freeze_startup_heap() -> None:
    """For a process that lives as long as its engine: move what start-up made (modules, the model's Python objects)
    out of the cyclic collector's reach, so that later full collections skip them, and so does the one at exit,
    which otherwise holds a stopping server for seconds. Garbage is collected first; what is frozen is never freed,
    hence not for ``LLM`` in a caller's process, where engines come and go."""
    gc.collect()
    gc.freeze()
    logging.getLogger("pagedllm").debug("start-up heap frozen: %d objects", gc.get_freeze_count())
