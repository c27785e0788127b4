"""Fixtures the backend tests share."""

import logging

import pytest


@pytest.fixture()
def pagedllm_logs(caplog):
    logger = logging.getLogger("pagedllm")
    logger.addHandler(caplog.handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(old)


@pytest.fixture(scope="session")
def openvino_export_dir(tmp_path_factory):
    """Where the openvino backend tests export the tiny models: one folder per session, shared by the test modules
    (the tiny models live in per-session folders, so their exports cannot outlive the session anyway)."""
    return tmp_path_factory.getbasetemp() / "openvino-export-cache"
