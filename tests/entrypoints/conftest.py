"""Fixtures for tests that drive a real ``pagedllm serve`` process (see server_process.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_cache import HUB_REPO, hub_cache
from server_process import ServerProcess
from tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """One tiny Llama (with a chat template) for the server tests; built once, without the other architectures."""
    return build_model("llama", tmp_path_factory.mktemp("server-model") / "llama")


@pytest.fixture(scope="session")
def tiny_llama_hub_cache(tiny_llama_dir, tmp_path_factory) -> Path:
    """A Hub cache holding the tiny Llama as ``HUB_REPO``: servers started with HF_HUB_CACHE set to it (and
    HF_HUB_OFFLINE=1) take the model by that id."""
    root = tmp_path_factory.mktemp("hub")
    hub_cache(root, HUB_REPO, tiny_llama_dir.iterdir())
    return root


@pytest.fixture
def start_server(tmp_path):
    """Start servers that are stopped (SIGTERM) at the end of the test."""
    servers = []

    def start(*args: str, env: dict[str, str] | None = None, **kwargs) -> ServerProcess:
        server = ServerProcess(list(args), tmp_path / f"server-{len(servers)}.log", env, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
