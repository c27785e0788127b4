"""A Hugging Face Hub cache laid out on disk as huggingface_hub lays it out, for tests that name a model by Hub id
with no network (HF_HUB_CACHE pointing at it, HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_REPO = "tiny-org/tiny-llama"  # the tiny Llama's id in the Hub cache of the tiny_llama_hub_cache fixture
OFFLINE = {"HF_HUB_OFFLINE": "1"}


def hub_cache(root: Path, repo: str, files) -> Path:
    """models--org--name/{refs/main, snapshots/COMMIT} under ``root``, the files copied into the snapshot."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in files:
        shutil.copy(f, snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    return snapshot
