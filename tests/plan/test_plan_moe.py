"""The planner sizes MoE deployments: total vs active parameters, memory per rank with expert
parallelism (checked against the engine's own model), the all-to-all in the step time, EP layouts in
the ranking, and the double-counting rule: EP is carved out of the TP ranks, never multiplied in."""
import json
from pathlib import Path

import pytest
import torch

from meshserve.cli import main
from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.layers.moe import GroupedExperts
from meshserve.models.model_config import ModelConfig
from meshserve.models.registry import model_class
from meshserve.plan import get_gpu, get_model
from meshserve.plan.layouts import Layout, enumerate_layouts
from meshserve.plan.params import model_params
from meshserve.plan.planner import PlanConfig, make_perf_model, plan
from meshserve.plan.timing import expected_max_to_mean

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def _plans(model, num_gpus: int, **kw) -> dict:
    spec = get_model(model) if isinstance(model, str) else model
    result = plan(PlanConfig(model=spec, gpu=get_gpu("H100-SXM"), num_gpus=num_gpus, max_model_len=8192, **kw))
    return {p.layout.name: p for p in result.plans}


def test_total_and_active_parameters():
    for name, total, active in (("Qwen3-30B-A3B", 30.5e9, 3.3e9), ("Mixtral-8x7B", 46.7e9, 12.9e9)):
        spec = get_model(name)
        counts = model_params(spec)
        assert counts.total == pytest.approx(total, rel=0.01)
        assert counts.active(spec) == pytest.approx(active, rel=0.03)
    # The real geometries shipped for load_format=dummy count the same from their config.json.
    for file, total in (("qwen3-30b-a3b.json", 30.5e9), ("mixtral-8x7b.json", 46.7e9)):
        assert model_params(get_model(str(CONFIGS / file))).total == pytest.approx(total, rel=0.01)


def test_ep_never_multiplies_the_gpu_count():
    """Seed rule: EP is derived from the TP (x DP) ranks of the MoE layers; TP x PP x DP x EP would
    count the same GPUs twice."""
    layouts = enumerate_layouts(8, moe=True)
    ep = [lay for lay in layouts if lay.ep]
    assert {(lay.tp, lay.pp, lay.dp) for lay in ep} == {(lay.tp, lay.pp, lay.dp) for lay in layouts if lay.tp > 1}
    for lay in layouts:
        assert lay.num_gpus == lay.tp * lay.pp * lay.dp == 8
        assert lay.ep_size == (lay.tp if lay.ep else 1)
    assert Layout(2, 1, 4, ep=True).name == "TP2 PP1 DP4 EP2"
    assert Layout(2, 1, 4, ep=True).num_gpus == 8  # a multiplying calculator would ask for 16
    plans = _plans("Qwen3-30B-A3B", 8)
    # The same GPUs hold the experts with or without EP: whole experts E/TP per rank = a 1/TP slice of each.
    for name in ("TP2 PP1 DP4", "TP4 PP2 DP1", "TP8 PP1 DP1"):
        assert plans[f"{name} EP{name[2]}"].memory.weights_per_gpu_bytes == plans[name].memory.weights_per_gpu_bytes
    assert not any(lay.ep for lay in enumerate_layouts(8))  # dense models get no EP variants


def test_memory_per_rank_with_ep_matches_the_engine_model():
    """Build Qwen3-30B-A3B's rank 0 under TP=4 with EP on the meta device: its expert bytes are exactly
    the planner's, its whole shard within the router's replication (the planner splits it by TP)."""
    cfg = ModelConfig.from_json_file(CONFIGS / "qwen3-30b-a3b.json")
    spec = get_model(str(CONFIGS / "qwen3-30b-a3b.json"))
    set_parallel_state(ParallelState(tp_size=4, ep_size=4))
    try:
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg)
    finally:
        set_parallel_state(ParallelState())
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 48 and all(e.num_local == 32 for e in experts)
    engine_expert_bytes = 2 * sum(p.numel() for e in experts for p in e.parameters())  # bf16
    engine_bytes = 2 * sum(p.numel() for p in model.parameters())
    ep4 = plan(PlanConfig(model=spec, gpu=get_gpu("H100-SXM"), num_gpus=4, tensor_parallel_size=4,
                          enable_expert_parallel=True, max_model_len=8192)).plans[0]
    assert ep4.layout.name == "TP4 PP1 DP1 EP4"
    from meshserve.plan.memory import shard_stages
    assert engine_expert_bytes == 2 * shard_stages(spec, model_params(spec), 4, 1)[0].experts
    assert engine_bytes == pytest.approx(ep4.memory.weights_per_gpu_bytes, rel=0.005)


def test_all_to_all_is_in_the_step_time():
    spec, gpu = get_model("Qwen3-30B-A3B"), get_gpu("H100-SXM")
    kw = dict(weight_dtype="bf16", kv_dtype="bf16", gpus_per_node=8, compute_efficiency=0.7)
    tp = make_perf_model(spec, gpu, 4, 1, **kw)
    ep = make_perf_model(spec, gpu, 4, 1, ep=True, **kw)
    skewed = make_perf_model(spec, gpu, 4, 1, ep=True, moe_load_max_to_mean=2.0, **kw)
    tp_parts, ep_parts = (m.decode_stage_parts(m.stages[0], 64, 1024) for m in (tp, ep))
    assert tp_parts["all_to_all_dispatch"] == tp_parts["all_to_all_combine"] == 0
    assert ep_parts["all_to_all_dispatch"] > 0 and ep_parts["all_to_all_combine"] > 0
    # An EP MoE layer reduces once (after attention) instead of twice.
    assert ep_parts["all_reduce"] == pytest.approx(tp_parts["all_reduce"] / 2)
    assert ep.decode_step_time(64, 1024) == pytest.approx(sum(ep_parts.values()))
    assert skewed.decode_step_time(64, 1024) > ep.decode_step_time(64, 1024)
    # Uniform routing's expected imbalance: none on one rank, larger for few tokens, at most all on one.
    assert expected_max_to_mean(1000, 1) == 1.0
    assert 1.0 < expected_max_to_mean(4096, 4) < expected_max_to_mean(64, 4) <= 4.0
    assert expected_max_to_mean(1, 8) == 8.0


def test_ep_layouts_are_ranked_and_checked():
    plans = _plans("Qwen3-30B-A3B", 8)
    assert plans["TP4 PP1 DP2 EP4"].rank is not None and plans["TP4 PP1 DP2"].rank is not None
    mixtral = _plans("Mixtral-8x7B", 16, weight_dtype="fp8")  # 8 experts
    assert "does not divide the 8 experts" in mixtral["TP16 PP1 DP1 EP16"].reasons[0]
    assert mixtral["TP16 PP1 DP1"].memory is not None  # sliced experts: 14336 / 16 is whole
    assert mixtral["TP8 PP1 DP2 EP8"].valid


def test_cli_pins_expert_parallel(capsys):
    argv = ["plan", "--model", "Qwen3-30B-A3B", "--gpu", "H100-SXM", "--num-gpus", "8", "--enable-expert-parallel",
            "--moe-load-max-to-mean", "1.5", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["active_params"] == pytest.approx(3.35e9, rel=0.02)
    for layout in doc["layouts"]:
        assert layout["num_gpus"] == 8 and layout["ep"] == layout["tp"]
        if layout["tp"] > 1 and layout["time"]:
            assert layout["time"]["decode_step_batch1_parts_ms"]["all_to_all_dispatch"] > 0
    assert main(["plan", "--model", "Llama-3.1-8B", "--gpu", "H100-SXM", "--enable-expert-parallel"]) == 2
    assert "--enable-expert-parallel needs a mixture-of-experts model" in capsys.readouterr().err
