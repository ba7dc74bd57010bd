"""Expert parallelism gives the single-rank tokens under every layout, routes exactly the same tokens
to the same experts, and reports dispatch and combine time on every rank."""
import pytest
from moe_helpers import run_greedy

LAYOUTS = {
    "EP2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "EP4": dict(tensor_parallel_size=4, enable_expert_parallel=True),
    "TP2": dict(tensor_parallel_size=2),  # experts sliced, not split
    "TP2xPP2-EP2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, enable_expert_parallel=True),
}
CASES = [("qwen3_moe", "EP2"), ("qwen3_moe", "EP4"), ("qwen3_moe", "TP2"), ("qwen3_moe", "TP2xPP2-EP2"),
         ("qwen2_moe", "EP2"), ("qwen2_moe", "EP4"), ("mixtral", "EP4")]


@pytest.fixture(scope="module")
def single_rank(tiny_moe):
    runs = {}

    def get(family: str):
        if family not in runs:
            runs[family] = run_greedy(tiny_moe(family)[0])
        return runs[family]

    return get


@pytest.mark.parametrize("family,layout", CASES)
def test_layout_matches_single_rank(tiny_moe, single_rank, family, layout):
    path, reference = tiny_moe(family)
    ids, load, timing = run_greedy(path, **LAYOUTS[layout])
    assert ids == reference
    # The same tokens went to the same experts, whichever rank held them.
    assert load["tokens"] == single_rank(family)[1]["tokens"]
    kw = LAYOUTS[layout]
    ranks = kw["tensor_parallel_size"] * kw.get("pipeline_parallel_size", 1)
    assert set(timing["total"]) == set(range(ranks))
    for t in timing["total"].values():
        if kw.get("enable_expert_parallel"):
            assert load["ep_size"] == kw["tensor_parallel_size"]
            assert t["comm"]["all_to_all_dispatch"] > 0 and t["comm"]["all_to_all_combine"] > 0
        else:
            assert load["ep_size"] == 1 and "all_to_all_dispatch" not in t["comm"]
