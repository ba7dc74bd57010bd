"""Session fixtures: tiny checkpoints and their greedy TP=1 outputs, the reference every parallel
layout must reproduce token for token."""
from __future__ import annotations

import pytest
from parallel_helpers import generate_ids, make_tiny_model


@pytest.fixture(scope="session")
def tiny_kv2(tmp_path_factory) -> str:
    """8 heads, 2 KV heads, 4 layers: TP=4 replicates each KV head on two ranks."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_kv2"), 2, 4))


@pytest.fixture(scope="session")
def tiny_kv4(tmp_path_factory) -> str:
    """8 heads, 4 KV heads, 8 layers."""
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny_kv4"), 4, 8))


@pytest.fixture(scope="session")
def reference_kv2(tiny_kv2) -> list[list[int]]:
    return generate_ids(tiny_kv2)


@pytest.fixture(scope="session")
def reference_kv4(tiny_kv4) -> list[list[int]]:
    return generate_ids(tiny_kv4)
