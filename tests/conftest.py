import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import ALL_ARCHITECTURES, build_model  # noqa: E402

os.environ.setdefault("PAGEDLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_model(arch, root / arch) for arch in ALL_ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]
