"""Fixtures for the benchmark tests."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .helpers import E2E_SERVER_ARGS, REAL_SERVER_ENV, fake_server


@pytest.fixture(scope="module")
def e2e_url() -> Iterator[str]:
    if os.environ.get(REAL_SERVER_ENV):
        yield os.environ[REAL_SERVER_ENV]
        return
    with fake_server(*E2E_SERVER_ARGS) as url:
        yield url
