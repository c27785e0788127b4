"""llama.cpp (through llama-cpp-python) in a virtual environment of its own, cached outside the repo.

llama-cpp-python's PyPI release is a source package: pip builds llama.cpp from it with CMake, for this CPU's kind:
the x86-64 instruction sets up to AVX-512 with VNNI and BF16 where the CPU has AVX-512 (Zen 4/5, Xeons), else up to
AVX2 (a build with AVX-512 dies of SIGILL there). Not AMX: this release's AMX kernels die of SIGILL on their first
tile load on the AMX Xeon this was measured on (``GGML_NATIVE=ON`` turns them on), so llama.cpp runs its AVX-512
kernels there. Each kind's wheel is built once and cached; its venv holds it and numpy.

llama.cpp's own HTTP server (``llama-server``, its continuous batching over slots), the peer of a served workload, is
built with CMake from the llama.cpp sources the same release vendors, with the same arguments, once per kind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_AVX2_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
_OFF_ARGS = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
# CMake arguments of each kind of build (the cached wheel's tag)
CMAKE_ARGS_BY_TAG = {
    "avx512": _AVX2_ARGS + "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
              + _OFF_ARGS,
    "avx2": _AVX2_ARGS + "-DGGML_AVX512=OFF " + _OFF_ARGS,
}


def build_tag() -> str:
    """The kind of build this CPU runs: avx512 where it has AVX-512 F, BW, VL, VBMI, VNNI and BF16, else avx2."""
    from pagedllm.backends.common.cpu_features import cpu_flags

    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512_vbmi", "avx512_vnni", "avx512_bf16"}
    return "avx512" if wanted <= cpu_flags() else "avx2"
MARKER = "pagedllm-setup.json"


def default_venv_dir() -> Path:
    """$PAGEDLLM_LLAMA_CPP_VENV, else llama-cpp-venv-<build tag> in pagedllm's cache directory."""
    if env := os.environ.get("PAGEDLLM_LLAMA_CPP_VENV"):
        return Path(env)
    from pagedllm.models.source import cache_dir

    return cache_dir() / f"llama-cpp-venv-{build_tag()}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list, log, env: dict | None = None) -> None:
    print("$", " ".join(str(c) for c in cmd), file=log, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, stdout=log, stderr=subprocess.STDOUT, env=env)


def ensure_venv(venv: Path, log=sys.stderr) -> dict:
    """Build the wheel (cached beside the venv) and fill the venv, unless a finished setup is recorded there."""
    marker = venv / MARKER
    if marker.is_file():
        return json.loads(marker.read_text())
    start = time.time()
    tag = build_tag()
    cmake_args = CMAKE_ARGS_BY_TAG[tag]
    wheels = venv.parent / "wheels" / tag
    wheel = next(iter(sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-*.whl"))), None)
    if wheel is None:
        print(f"building llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} from source (llama.cpp with CMake, "
              f"{cmake_args}; several minutes on 2 cores)", file=log, flush=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", "llama-cpp-python",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-w", wheels], log, env)
        wheel = next(iter(sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}-*.whl"))))
    shutil.rmtree(venv, ignore_errors=True)
    _run([sys.executable, "-m", "venv", venv], log)
    python = venv_python(venv)
    _run([python, "-m", "pip", "install", "-q", "numpy", "typing-extensions", "diskcache", "jinja2"], log)
    _run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], log)
    record = {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "wheel": str(wheel), "cmake_args": cmake_args,
              "setup_seconds": time.time() - start}
    marker.write_text(json.dumps(record))
    return record


def probe(venv: Path) -> str | None:
    """Why ``import llama_cpp`` fails in the venv, or None."""
    proc = subprocess.run([str(venv_python(venv)), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def server_dir() -> Path:
    """$PAGEDLLM_LLAMA_SERVER_DIR, else llama-server-<build tag> in pagedllm's cache directory."""
    if env := os.environ.get("PAGEDLLM_LLAMA_SERVER_DIR"):
        return Path(env)
    from pagedllm.models.source import cache_dir

    return cache_dir() / f"llama-server-{build_tag()}"


def ensure_server(folder: Path, log=sys.stderr) -> Path:
    """The ``llama-server`` binary, built in ``folder`` on first use: the release's source package from PyPI, its
    vendored llama.cpp configured with this kind's arguments (no web UI, no HTTPS), only the server's target built."""
    binary = folder / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    start = time.time()
    print(f"building llama.cpp's llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s sources "
          f"(several minutes on 2 cores)", file=log, flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", folder], log)
    sdist = folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        shutil.rmtree(folder / "src", ignore_errors=True)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.12, and 3.10/3.11 patches
        tar.extractall(folder / "src", members=members, **safe)
    cmake_args = CMAKE_ARGS_BY_TAG[build_tag()].split() + [
        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    _run(["cmake", "-S", folder / "src", "-B", folder / "build", *cmake_args], log)
    _run(["cmake", "--build", folder / "build", "--target", "llama-server", "-j", str(os.cpu_count() or 2)], log)
    sdist.unlink()
    print(f"built {binary} in {time.time() - start:.0f} s", file=log, flush=True)
    return binary
