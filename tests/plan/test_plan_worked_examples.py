"""Every worked number of the two capacity notes the planner is checked against.

Note A (serving beyond one GPU): a 72.7e9-parameter model with Qwen2.5-72B geometry, bf16, on
80 GiB GPUs with TP=4, 90% utilization and an 8 GiB reserve. Note B (distributed inference in
vLLM/SGLang): Llama-3-70B TP limits and batch-1 decode bounds on H100 (3.35 TB/s).
"""
from dataclasses import replace

import pytest

from meshserve.plan import PlanConfig, get_gpu, get_model, plan
from meshserve.plan.memory import max_tp_without_kv_replication
from meshserve.plan.timing import (
    decode_tokens_per_s_bound,
    kv_handoff_time,
    pipeline_efficiency,
)
from meshserve.plan.units import GB, GiB


def qwen72b_plan(max_model_len=8192):
    result = plan(PlanConfig(get_model("Qwen2.5-72B"), get_gpu("A100-80GB"), num_gpus=4,
                             tensor_parallel_size=4, pipeline_parallel_size=1, gpu_memory_gib=80,
                             gpu_memory_utilization=0.90, runtime_reserve_gib=8,
                             max_model_len=max_model_len))
    (only,) = result.shown
    return only.memory


def test_weights_in_gb_and_gib():
    mem = qwen72b_plan()
    assert f"{mem.weights_total_bytes / GB:.1f}" == "145.4"
    assert f"{mem.weights_total_bytes / GiB:.2f}" == "135.41"
    assert f"{mem.weights_per_gpu_bytes / GiB:.2f}" == "33.85"


def test_kv_per_sequence_available_memory_and_ceiling():
    mem = qwen72b_plan()
    assert mem.kv_bytes_per_seq / GiB == 2.5                 # 2 x 80 x 8 x 128 x 8192 x 2 bytes
    assert mem.kv_bytes_per_seq_per_gpu / GiB == 0.625
    assert f"{mem.kv_available_per_gpu_bytes / GiB:.2f}" == "30.15"  # 80 x 0.9 - 33.85 - 8
    assert mem.max_seqs == 48
    assert qwen72b_plan(max_model_len=32768).max_seqs == 12


def test_kv_handoff_times():
    kv = qwen72b_plan().kv_bytes_per_seq
    assert f"{kv / GB:.3f}" == "2.684"
    assert f"{kv_handoff_time(kv, 25 * GB) * 1e3:.1f}" == "107.4"
    assert f"{kv_handoff_time(kv, 25 * GB, 5e-3) * 1e3:.1f}" == "112.4"
    assert f"{kv_handoff_time(kv, 12.5 * GB, 5e-3) * 1e3:.1f}" == "219.7"


def test_pipeline_bubble():
    assert pipeline_efficiency(1, 4) == 0.25
    assert round(pipeline_efficiency(16, 4) * 100) == 84


def test_a100_40gb_ridge_point_near_200():
    assert get_gpu("A100-40GB").ridge_point("bf16") == pytest.approx(200, abs=1)


def test_llama3_70b_largest_tp_without_kv_replication_is_8():
    spec = get_model("Llama-3-70B")
    assert max_tp_without_kv_replication(spec) == 8
    flagged = plan(PlanConfig(spec, get_gpu("H100-SXM"), num_gpus=16, tensor_parallel_size=16,
                              pipeline_parallel_size=1)).shown[0]
    assert any("replicated x2" in f for f in flagged.flags)


def decode_bounds(weight_dtype, num_params=None, embedding_dtype=None):
    """Batch-1 decode ceiling per user: HBM bandwidth / weight bytes on one rank."""
    spec = get_model("Llama-3-70B")
    if num_params:
        spec = replace(spec, num_params=num_params)
    gpu = get_gpu("H100-SXM")
    bounds = []
    for tp in (2, 4, 8):
        result = plan(PlanConfig(spec, gpu, num_gpus=tp, tensor_parallel_size=tp, pipeline_parallel_size=1,
                                 weight_dtype=weight_dtype, embedding_dtype=embedding_dtype))
        bounds.append(decode_tokens_per_s_bound(result.shown[0].memory.weights_per_gpu_bytes,
                                                gpu.hbm_bandwidth))
    return bounds


def test_decode_bounds_96_190_380_hold_for_fp8_weights():
    """The note counts every weight in fp8, the embedding and LM head too (the engine keeps those in
    bf16 by default, which costs 2.1 GB more: about 3% slower here)."""
    assert get_gpu("H100-SXM").hbm_bandwidth == 3.35e12
    for got, quoted in zip(decode_bounds("fp8", embedding_dtype="fp8"), (96, 190, 380)):
        assert got == pytest.approx(quoted, rel=0.02)
    # With the note's round 70e9 parameters: 95.7, 191.4, 382.9 tok/s, less what the note leaves out:
    # fp8's float32 row scales (o_proj's and down_proj's rows on every rank) and the norms in bf16,
    # 0.04% at TP=2, 0.1% at TP=8.
    assert [round(b, 1) for b in decode_bounds("fp8", 70e9, "fp8")] == [95.7, 191.3, 382.5]
    assert decode_bounds("fp8", 70e9, "fp8") == pytest.approx([95.7, 191.4, 382.9], rel=1.2e-3)
    slower = decode_bounds("fp8", 70e9)  # the embedding and head in bf16
    assert [round(b / a, 3) for a, b in zip(decode_bounds("fp8", 70e9, "fp8"), slower)] == [0.971] * 3


def test_decode_bounds_for_fp16_weights_are_half():
    fp8, fp16 = decode_bounds("fp8", embedding_dtype="fp8"), decode_bounds("fp16")
    for a, b in zip(fp8, fp16):
        assert b == pytest.approx(a / 2, rel=1e-3)  # fp8's row scales and bf16 norms aside
    assert [round(b, 1) for b in decode_bounds("fp16", 70e9)] == [47.9, 95.7, 191.4]

