"""Greedy float32 token ids under every parallel layout equal the single-rank engine's."""
import json
import logging

import pytest
from parallel_helpers import ENGINE_ARGS, GREEDY, generate_ids, prompts
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshserve import LLM, SamplingParams
from meshserve.server.metrics import register_parallel_metrics


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 4), (2, 2)])
def test_layouts_match_single_rank_kv2(tiny_kv2, reference_kv2, tp, pp):
    assert generate_ids(tiny_kv2, tensor_parallel_size=tp, pipeline_parallel_size=pp) == reference_kv2


def test_tp_beyond_kv_heads_replicates_them(tiny_kv2, reference_kv2, caplog):
    """TP=4 over 2 KV heads: each rank holds one (replicated) KV head, and the start-up log says the
    per-rank KV cache stops shrinking."""
    with caplog.at_level(logging.WARNING, logger="meshserve"):
        llm = LLM(tiny_kv2, tensor_parallel_size=4, **ENGINE_ARGS)
    try:
        assert "replicated on 2 ranks" in caplog.text
        infos = llm.engine.executor.infos
        assert [infos[r]["num_kv_heads"] for r in range(4)] == [1, 1, 1, 1]
        outs = llm.generate(prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference_kv2
        # The engine's stats carry every rank's time in the all-reduces into the Prometheus series.
        registry = CollectorRegistry()
        register_parallel_metrics(registry, lambda: llm.engine.get_stats().parallel_timing)
        families = text_string_to_metric_families(generate_latest(registry).decode())
        reduced = {s.labels["rank"]: s.value for fam in families for s in fam.samples
                   if s.name == "meshserve:communication_seconds_total" and s.labels["kind"] == "all_reduce"}
        assert set(reduced) == {"0", "1", "2", "3"} and min(reduced.values()) > 0
    finally:
        llm.engine.shutdown()


def test_uneven_pipeline_split_and_full_kv_sharding(tiny_kv4, reference_kv4):
    llm = LLM(tiny_kv4, pipeline_parallel_size=2, pipeline_split=[3, 5], **ENGINE_ARGS)
    try:
        infos = llm.engine.executor.infos
        assert [i["layers"] for i in infos] == [[0, 1, 2], [3, 4, 5, 6, 7]]
        # Each rank fits its own layers' K/V in the budget; the engine uses the smaller block count.
        assert infos[1]["block_bytes"] > infos[0]["block_bytes"]
        assert llm.engine.block_manager.num_blocks == ENGINE_ARGS["kv_cache_memory_bytes"] // infos[1]["block_bytes"]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)] == reference_kv4
    finally:
        llm.engine.shutdown()
    assert generate_ids(tiny_kv4, tensor_parallel_size=4) == reference_kv4


def test_tp3_matches_tp1_on_default_model():
    """SmolLM2-135M: 9 heads, 3 KV heads, so TP=3 puts one KV head on each rank."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ids = []
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
        try:
            ids.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.engine.shutdown()
    assert ids[0] == ids[1]


def test_profile_dir_gets_a_trace_per_rank_and_a_timing_table(tiny_kv2, reference_kv2, tmp_path):
    """TP=2 x PP=2 with profiling: the same tokens, a torch.profiler trace per rank, and a per-rank
    table of compute versus communication time where every rank communicated."""
    assert generate_ids(tiny_kv2, tensor_parallel_size=2, pipeline_parallel_size=2,
                        profile_dir=str(tmp_path)) == reference_kv2
    for rank in range(4):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        assert any(e.get("name") == "meshserve_step" for e in trace["traceEvents"])
    table = (tmp_path / "step_timing.txt").read_text().splitlines()
    assert "comm share" in table[1]
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert set(rows) == {"0", "1", "2", "3", "all"}
    for rank in "0123":
        all_reduce, send_recv = float(rows[rank][4]), float(rows[rank][6])
        assert all_reduce > 0 and send_recv > 0  # TP peers reduce, stages pass activations
