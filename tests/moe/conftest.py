"""Session fixtures: a tiny checkpoint of each MoE family and transformers' greedy tokens for it."""
from __future__ import annotations

import pytest
from moe_helpers import hf_greedy, make_tiny_moe, prompts

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """family -> (checkpoint directory, transformers' greedy tokens for prompts())."""
    made = {}

    def get(family: str) -> tuple[str, list[list[int]]]:
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            model = make_tiny_moe(path, family)
            made[family] = (str(path), hf_greedy(model, prompts()))
        return made[family]

    return get
