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
