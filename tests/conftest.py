import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ALL_ARCHITECTURES, build_model  # noqa: E402

os.environ.setdefault("PAGEDLLM_LOGGING_LEVEL", "WARNING")


def pytest_report_header(config):
    """Which kind of CPU this run proves: every CI log names it."""
    from pagedllm.backends.common import cpu_features

    auto = "bfloat16" if cpu_features.has_native_bf16() else "float32"
    return [f"CPU: {cpu_features.describe()}; --dtype auto -> {auto} on the cpu backend"]


@pytest.fixture(autouse=True)
def _the_test_thread_keeps_its_cpus():
    """The engine pins the thread that steps it until LLM.generate returns or the engine shuts down; a test that
    steps an engine by hand and keeps it would leave later tests, and the processes they start, on one CPU."""
    before = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, before)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_model(arch, root / arch) for arch in ALL_ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture()
def isolated_cache_dir(tmp_path) -> Path:
    """A PAGEDLLM_CACHE_DIR of the test's own (converted models, exports), sharing the user's compiled kernels: a
    kernel build takes a minute, and the kernels do not depend on what else is cached."""
    from pagedllm.models.source import cache_dir

    shared = cache_dir() / "kernels"
    shared.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "cache"
    path.mkdir()
    (path / "kernels").symlink_to(shared, target_is_directory=True)
    return path
