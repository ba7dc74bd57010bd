"""The skew instruments: a router biased to one expert shows max-to-mean well above 1 in /metrics and
/moe/expert_load; a balanced one shows 1. Both routers are built into the tiny Qwen3-MoE checkpoint:
the embedding writes token t's identity into hidden dimensions t % 8 and (t + 4) % 8, and the router
reads those dimensions, so token t picks experts t % 8 and (t + 4) % 8 (one on each of two EP ranks);
the biased router adds expert 0 a logit bonus on top, making it every token's first choice."""
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import torch
from moe_helpers import ENGINE_ARGS
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from meshserve import LLM, SamplingParams
from meshserve.server.metrics import register_moe_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import ServerProcess

NUM_EXPERTS = 8


def _routed_by_token(src: str, dst, hot_expert_bonus: float) -> str:
    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    emb = weights["model.embed_tokens.weight"]
    t = torch.arange(emb.shape[0])
    emb[t, t % NUM_EXPERTS] += 30
    emb[t, (t + NUM_EXPERTS // 2) % NUM_EXPERTS] += 24
    for name in weights:
        if name.endswith("mlp.gate.weight"):
            gate = torch.zeros_like(weights[name])
            gate[range(NUM_EXPERTS), range(NUM_EXPERTS)] = 5.0
            gate[0, :NUM_EXPERTS] += hot_expert_bonus
            weights[name] = gate
    save_file(weights, f"{dst}/model.safetensors")
    return str(dst)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (48,), generator=g).tolist() for _ in range(6)]


def _gauges(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.endswith("max_to_mean")}


@pytest.fixture(scope="module")
def routers(tiny_moe, tmp_path_factory):
    base = tiny_moe("qwen3_moe")[0]
    tmp = tmp_path_factory.mktemp("routers")
    return _routed_by_token(base, tmp / "balanced", 0.0), _routed_by_token(base, tmp / "biased", 4.0)


def test_balanced_router_reads_one(routers):
    llm = LLM(routers[0], tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE_ARGS)
    try:
        llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        registry = CollectorRegistry()
        register_moe_metrics(registry, lambda: llm.engine.get_stats().expert_load)
        text = generate_latest(registry).decode()
    finally:
        llm.engine.shutdown()
    gauges = _gauges(text)
    assert gauges["meshserve:moe_rank_load_max_to_mean"] == 1.0  # one expert of each token per rank
    assert 1.0 < gauges["meshserve:moe_expert_load_max_to_mean"] < 1.3
    ranks = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == "meshserve:moe_rank_tokens_total"]
    assert len(ranks) == 2 and ranks[0] == ranks[1] > 0


def test_biased_router_shows_in_metrics_and_endpoint(routers):
    """`meshserve serve --enable-expert-parallel -tp 2`: the gauges in /metrics and the full matrix
    at /moe/expert_load show expert 0 taking every token."""
    server = ServerProcess(["-m", "meshserve", "serve", routers[1], "--tensor-parallel-size", "2",
                            "--enable-expert-parallel", "--dtype", "float32", "--max-model-len", "256",
                            "--kv-cache-memory", "4MiB"])
    try:
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for ids in _prompts():
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
        gauges = _gauges(httpx.get(url + "/metrics", timeout=10).text)
        assert gauges["meshserve:moe_expert_load_max_to_mean"] == pytest.approx(NUM_EXPERTS / 2)  # k=2 of 8
        assert gauges["meshserve:moe_rank_load_max_to_mean"] > 1.2
        load = httpx.get(url + "/moe/expert_load", timeout=10).json()
        assert (load["num_experts"], load["ep_size"], load["experts_per_rank"]) == (8, 2, 4)
        assert [layer["layer"] for layer in load["layers"]] == [0, 1]
        for layer in load["layers"]:
            total = sum(layer["tokens"])
            assert layer["tokens"][0] == total // 2  # every token's first choice
            assert layer["rank_tokens"][0] > layer["rank_tokens"][1] and sum(layer["rank_tokens"]) == total
        out = server.output()
    finally:
        server.stop()
    assert "expert parallelism: EP=2 ranks per stage" in out and "4 of 8 experts per rank" in out

