"""A test-only backend plugin: the cpu backend, except that ``execute`` (and ``encode``) raises when told to.

The tests arm it by writing a count into the file named by ``PAGEDLLM_TEST_FAULTS``: that many of the next steps
raise ``InjectedFault``; ``hang`` writes ``hang SECONDS``: the next step sleeps that long first (a step that
hangs). A file, so that an engine-core process (which registers this module through an entry point
the tests put on PYTHONPATH, see ``plugin_path``) is armed the same way as an in-process engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pagedllm.backends.cpu.backend import CPUBackend
from pagedllm.plugins import hookimpl

FAULTS_ENV = "PAGEDLLM_TEST_FAULTS"
NAME = "faulty"


class InjectedFault(RuntimeError):
    pass


class FaultyBackend(CPUBackend):
    name = NAME

    def execute(self, batch):
        _apply_fault()
        return super().execute(batch)

    def encode(self, batch):
        _apply_fault()
        return super().encode(batch)


def _apply_fault() -> None:
    fault = _take_fault()
    if fault == "raise":
        raise InjectedFault("injected fault")
    if fault is not None:
        time.sleep(float(fault))


def arm(path: Path, steps: int = 1) -> None:
    path.write_text(str(steps))


def hang(path: Path, seconds: float) -> None:
    path.write_text(f"hang {seconds}")


def _take_fault() -> str | None:
    """"raise", seconds to sleep, or None."""
    path = os.environ.get(FAULTS_ENV)
    if not path or not os.path.exists(path):
        return None
    text = Path(path).read_text().strip()
    if text.startswith("hang "):
        Path(path).write_text("0")
        return text.split()[1]
    left = int(text or 0)
    if left <= 0:
        return None
    Path(path).write_text(str(left - 1))
    return "raise"


def plugin_path(folder: Path) -> str:
    """A PYTHONPATH under which this module is a ``pagedllm`` plugin (an entry point in a bare dist-info)."""
    dist = folder / "pagedllm_faulty-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pagedllm-faulty\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[pagedllm]\n{NAME} = faulty_backend\n")
    return os.pathsep.join([str(folder), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])


@hookimpl
def register_backends(register):
    register(FaultyBackend)
