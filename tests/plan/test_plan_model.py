"""Catalog, geometry, memory, validity, timing and ranking rules of the planner."""
import json
import math

import pytest

from meshserve.models.model_config import ModelConfig
from meshserve.plan import GPUS, MODELS, PlanConfig, get_gpu, get_model, plan
from meshserve.plan.goodput import Workload, operating_point, slo_capacity
from meshserve.plan.memory import kv_bytes_per_token
from meshserve.plan.params import count_params, model_params
from meshserve.plan.planner import make_perf_model
from meshserve.plan.timing import ring_allreduce_time
from meshserve.plan.units import GiB

REQUIRED_MODELS = ["Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Llama-3.3-70B", "Qwen2.5-7B",
                   "Qwen2.5-72B", "Mistral-7B", "Mixtral-8x7B", "DeepSeek-V3", "SmolLM2-135M"]
REQUIRED_GPUS = ["A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "L40S", "B200"]


def layouts(model, gpu, n, **kw):
    return {p.layout.name: p for p in plan(PlanConfig(get_model(model), get_gpu(gpu), num_gpus=n, **kw)).plans}


def test_catalog_has_the_required_entries_and_geometry_matches_published_counts():
    assert set(REQUIRED_MODELS) <= set(MODELS) and set(REQUIRED_GPUS) <= set(GPUS)
    for spec in MODELS.values():
        assert count_params(spec).total == pytest.approx(spec.num_params, rel=2e-3), spec.name
    assert get_model("DeepSeek-V3").kind == "MoE+MLA"
    assert get_model("Mixtral-8x7B").kind == "MoE"
    mixtral = get_model("Mixtral-8x7B")
    assert model_params(mixtral).active(mixtral) == pytest.approx(12.9e9, rel=0.01)
    ds = get_model("DeepSeek-V3")
    assert model_params(ds).active(ds) == pytest.approx(37e9, rel=0.02)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="Qwen2.5-72B"):
        get_model("GPT-5")
    with pytest.raises(ValueError, match="H100-SXM.*this-machine"):
        get_gpu("TPU-v9")


def test_config_json_input_counts_parameters_from_geometry(tmp_path):
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
            "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(smol))
    spec = get_model(str(tmp_path))  # a directory holding config.json
    assert spec.num_params is None
    assert model_params(spec).total == 134_515_008  # SmolLM2-135M's exact count
    ds = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
          "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
          "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8,
          "moe_intermediate_size": 2048, "n_shared_experts": 1, "first_k_dense_replace": 3,
          "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
          "qk_nope_head_dim": 128, "v_head_dim": 128, "max_position_embeddings": 163840}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    spec = get_model(str(path))
    assert spec.kind == "MoE+MLA"
    assert model_params(spec).total == pytest.approx(671e9, rel=1e-3)
    with pytest.raises(ValueError, match="vocab_size"):
        from meshserve.plan.catalog import model_from_hf_config
        model_from_hf_config({k: v for k, v in smol.items() if k != "vocab_size"})


def test_kv_heads_replicate_once_tp_exceeds_them():
    plans = layouts("Llama-3.1-8B", "H100-SXM", 16, pipeline_parallel_size=1)
    tp8, tp16 = plans["TP8 PP1 DP2"].memory, plans["TP16 PP1 DP1"].memory
    assert tp16.kv_bytes_per_seq_per_gpu == tp8.kv_bytes_per_seq_per_gpu  # sharding stopped saving
    assert tp16.kv_replication == 2 and tp8.kv_replication == 1
    assert plans["TP4 PP1 DP4"].memory.kv_bytes_per_seq_per_gpu == 2 * tp8.kv_bytes_per_seq_per_gpu


def test_mla_latent_cache_is_small_and_replicated():
    ds = get_model("DeepSeek-V3")
    assert kv_bytes_per_token(ds, "bf16") == 61 * (512 + 64) * 2
    plans = layouts("DeepSeek-V3", "H200", 16, weight_dtype="fp8", pipeline_parallel_size=2)
    assert plans["TP8 PP2 DP1"].valid
    assert any("MLA latent cache replicated" in f for f in plans["TP8 PP2 DP1"].flags)


def test_fractional_sharding_is_rejected():
    qwen7 = layouts("Qwen2.5-7B", "H100-SXM", 8)                # 28 heads, 4 KV heads
    assert "fractional sharding" in qwen7["TP8 PP1 DP1"].reasons[0]
    assert qwen7["TP4 PP1 DP2"].valid
    smol = layouts("SmolLM2-135M", "L40S", 6)                   # 9 heads, 3 KV heads
    assert not smol["TP2 PP1 DP3"].valid and smol["TP3 PP1 DP2"].valid
    assert not smol["TP6 PP1 DP1"].valid                        # 9 heads over 6 ranks


def test_uneven_pipeline_split_is_flagged_and_fullest_stage_governs():
    plans = layouts("Llama-3.1-405B", "B200", 16, weight_dtype="fp8")   # 126 layers
    uneven = plans["TP4 PP4 DP1"]
    assert any("uneven pipeline split: stages of 32 and 31" in f for f in uneven.flags)
    even = plans["TP8 PP2 DP1"]
    assert not any("uneven" in f for f in even.flags)
    # Same 16-way weight split, but the 32-layer stage holds more than 1/16 of the layers.
    assert uneven.memory.weights_per_gpu_bytes > even.memory.weights_per_gpu_bytes


def test_tp_across_nodes_is_flagged_and_slower_than_pp_across_nodes():
    plans = layouts("Llama-3.1-405B", "H100-SXM", 16)
    cross = plans["TP16 PP1 DP1"]
    assert any("spans nodes" in f for f in cross.flags)
    assert cross.decode_batch1_s > plans["TP8 PP2 DP1"].decode_batch1_s


def test_a_tp_group_straddling_a_node_boundary_is_flagged():
    assert not layouts("Qwen2.5-7B", "H100-SXM", 12, gpus_per_node=8)["TP4 PP1 DP3"].flags
    straddles = layouts("SmolLM2-135M", "H100-SXM", 12, gpus_per_node=8)["TP3 PP1 DP4"]
    assert any("TP=3 spans nodes" in f for f in straddles.flags)   # ranks 6-8 cross a node
    assert not layouts("SmolLM2-135M", "H100-SXM", 6)["TP3 PP1 DP2"].flags


def test_weights_that_do_not_fit_are_rejected_with_the_reason():
    plans = layouts("Llama-3.1-70B", "H100-SXM", 1)
    assert "weights do not fit" in plans["TP1 PP1 DP1"].reasons[0]
    result = plan(PlanConfig(get_model("Llama-3.1-70B"), get_gpu("H100-SXM"), num_gpus=1))
    assert result.recommended is None and result.decision.layout is None


def test_ring_allreduce_model():
    assert ring_allreduce_time(1e6, 1, 2e-6, 100e9) == 0
    # 2(N-1)a + 2(N-1)S/(N b) = 12 us + 15 us
    assert ring_allreduce_time(1e6, 4, 2e-6, 100e9) == pytest.approx(27e-6)


def test_decode_is_memory_bound_and_tp_cuts_it():
    spec, gpu = get_model("Llama-3.1-8B"), get_gpu("H100-SXM")
    perf = {tp: make_perf_model(spec, gpu, tp, 1, weight_dtype="bf16", kv_dtype="bf16",
                                gpus_per_node=8, compute_efficiency=0.7) for tp in (1, 2)}
    t1 = perf[1].decode_step_time(1, 0)
    # Weights over bandwidth; the untied input embedding is only gathered (batch rows), not read.
    assert t1 == pytest.approx((8.03e9 - 128256 * 4096) * 2 / 3.35e12, rel=0.01)
    assert perf[2].decode_step_time(1, 0) < t1 < 2 * perf[2].decode_step_time(1, 0)
    # Batch 32 reads the same weights: far less than 32x the time of batch 1.
    assert perf[1].decode_step_time(32, 1024) < 4 * perf[1].decode_step_time(1, 1024)
    # Prefill is compute-bound: about 2 x params x tokens / achievable FLOP/s.
    assert perf[1].prefill_time(4096) == pytest.approx(2 * 8.03e9 * 4096 / (989.4e12 * 0.7), rel=0.15)


def test_pipeline_decode_fills_and_drains():
    spec, gpu = get_model("Llama-3.1-70B"), get_gpu("H100-SXM")
    kw = dict(weight_dtype="bf16", kv_dtype="bf16", gpus_per_node=8, compute_efficiency=0.7)
    pp1, pp4 = make_perf_model(spec, gpu, 1, 1, **kw), make_perf_model(spec, gpu, 1, 4, **kw)
    # Batch 1 is memory-bound: one micro-batch, 4 stages in turn - no faster than one GPU.
    t, m = pp4.decode_step(1, 0)
    assert m == 1 and t == pytest.approx(pp1.decode_step_time(1, 0), rel=0.02)
    # A compute-bound batch is split; the step pays the bubble: about (M + P - 1) stage times.
    t, m = pp4.decode_step(2048, 0)
    stage = max(pp4.decode_stage_time(st, 2048 / m, 0) for st in pp4.stages)
    assert m > 1 and t == pytest.approx((m + 3) * stage, rel=0.05)
    assert t < sum(pp4.decode_stage_time(st, 2048, 0) for st in pp4.stages)   # beats M = 1


def test_moe_decode_reads_only_the_experts_a_batch_touches():
    spec, gpu = get_model("Mixtral-8x7B"), get_gpu("H100-SXM")
    perf = make_perf_model(spec, gpu, 2, 1, weight_dtype="bf16", kv_dtype="bf16",
                           gpus_per_node=8, compute_efficiency=0.7)
    dense_equivalent = 46.7e9 * 2 / 2 / 3.35e12
    assert perf.decode_step_time(1, 0) < 0.4 * dense_equivalent     # 2 of 8 experts
    assert perf.decode_step_time(64, 0) > 0.9 * dense_equivalent    # all experts touched


def test_goodput_is_capped_by_slo_capacity_and_ranking_follows_it():
    kw = dict(slo_ttft_ms=2000, slo_itl_ms=50, request_rate=3.0, weight_dtype="fp8")
    result = plan(PlanConfig(get_model("Llama-3.3-70B"), get_gpu("H100-SXM"), num_gpus=8, **kw))
    ranked = [p for p in result.plans if p.valid]
    assert [p.rank for p in ranked] == list(range(1, len(ranked) + 1))
    goodputs = [p.goodput_rps for p in ranked]
    assert goodputs == sorted(goodputs, reverse=True)
    for p in ranked:
        assert p.goodput_rps == pytest.approx(min(3.0, p.capacity_rps))
        op = p.operating
        if op.meets_slo:
            assert op.itl_s <= 0.050 and op.ttft_s <= 2.0
    assert result.recommended is ranked[0]


def test_operating_point_follows_littles_law_and_slo_capacity_is_where_the_slo_binds():
    spec, gpu = get_model("Llama-3.1-8B"), get_gpu("H100-SXM")
    perf = make_perf_model(spec, gpu, 1, 1, weight_dtype="bf16", kv_dtype="bf16", gpus_per_node=8,
                           compute_efficiency=0.7)
    work = Workload(1024, 256, slo_ttft_s=0.5, slo_itl_s=0.02)
    op = operating_point(perf, 200, work, 5.0)
    assert op.stable
    assert op.concurrency == pytest.approx(5.0 * (op.ttft_s + 255 * op.itl_s), rel=1e-6)
    cap = slo_capacity(perf, 200, work)
    assert operating_point(perf, 200, work, cap * 0.99).meets_slo
    assert not operating_point(perf, 200, work, cap * 1.02).meets_slo
    looser = Workload(1024, 256, slo_ttft_s=1.0, slo_itl_s=0.04)
    assert slo_capacity(perf, 200, looser) > cap
    assert not operating_point(perf, 2, work, 50.0).stable          # KV cache full
    assert math.isinf(operating_point(perf, 2, work, 50.0).ttft_s)


@pytest.mark.parametrize("model,gpu,n,rule,layout", [
    ("Llama-3.1-8B", "H100-SXM", 8, "1.", "TP1 PP1 DP8"),
    ("Llama-3.1-70B", "H100-SXM", 8, "2.", "TP2 PP1 DP4"),
    ("Llama-3.1-405B", "H100-SXM", 16, "3.", "TP8 PP2 DP1"),
])
def test_decision_tree(model, gpu, n, rule, layout):
    decision = plan(PlanConfig(get_model(model), get_gpu(gpu), num_gpus=n)).decision
    assert decision.rule.startswith(rule) and decision.layout.name == layout


def test_inputs_are_validated():
    spec, gpu = get_model("Llama-3.1-8B"), get_gpu("H100-SXM")
    for kw, msg in [(dict(gpu_memory_utilization=1.5), "gpu-memory-utilization"),
                    (dict(num_gpus=4, tensor_parallel_size=3), "must divide"),
                    (dict(max_model_len=1024, prompt_len=1000, output_len=100), "exceeds"),
                    (dict(request_rate=-1), "request-rate")]:
        with pytest.raises(ValueError, match=msg):
            plan(PlanConfig(spec, gpu, **kw))
    noted = plan(PlanConfig(get_model("Llama-3-70B"), get_gpu("H200"), num_gpus=2, max_model_len=16384))
    assert "exceeds the model's 8192 positions" in noted.config.notes[0]


def test_gpu_memory_override_is_in_gib():
    plans = layouts("Llama-3.1-8B", "H100-SXM", 1, gpu_memory_gib=40)
    assert plans["TP1 PP1 DP1"].memory.memory_per_gpu_bytes == 40 * GiB


def test_every_layout_the_planner_ranks_is_one_the_engine_accepts():
    """One validity rule: for every catalog model and GPU count, a layout the planner keeps passes the
    engine's own check (and SmolLM2's TP=9, which its MLP of 1536 cannot split, is refused by both)."""
    from meshserve.models.sharding import ShardedDims, tp_size_problem
    from meshserve.plan.catalog import MODELS
    for name, spec in MODELS.items():
        for n in (1, 2, 3, 4, 6, 8, 9, 12, 16):
            for ranked in layouts(name, "H200", n, weight_dtype="fp8").values():
                accepted = tp_size_problem(spec.sharded_dims, ranked.layout.tp) is None
                if ranked.valid:
                    assert accepted, (name, n, ranked.layout)
                elif not accepted:
                    assert "fractional sharding" in " ".join(ranked.reasons)
    smol = MODELS["SmolLM2-135M"]
    assert ShardedDims.of(ModelConfig.from_hf_config({
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "vocab_size": 49152})) == smol.sharded_dims
    assert not layouts("SmolLM2-135M", "H200", 9)["TP9 PP1 DP1"].valid


def _profiled_cpu(**extra):
    """A CPU-like measured machine: 20 GB/s while few rows stream the weights, 200 GFLOP/s when
    many rows make the layer compute-bound (the profile's seconds per weight byte, fp32)."""
    import dataclasses

    profile = tuple((r, max(1 / 20e9, 2 * r / 4 / 200e9)) for r in (1, 8, 64, 512))
    base = get_gpu("L40S")
    fields = dict(name="this-machine", measured=True, hbm_bandwidth=20e9, fp32_flops=300e9,
                  bf16_flops=300e9, gemm_profile=profile, attention_flops=80e9, op_overhead_s=4e-6)
    return dataclasses.replace(base, **{**fields, **extra})


def test_gemm_profile_interpolates_by_rows_and_scales_past_the_last():
    gpu = _profiled_cpu()
    assert gpu.linear_seconds_per_byte(1) == pytest.approx(1 / 20e9)
    assert gpu.linear_seconds_per_byte(0.5) == pytest.approx(1 / 20e9)     # below the first row count
    mid = gpu.linear_seconds_per_byte(288)                                  # halfway from 64 to 512
    assert mid == pytest.approx((gpu.linear_seconds_per_byte(64) + gpu.linear_seconds_per_byte(512)) / 2)
    assert gpu.linear_seconds_per_byte(1024) == pytest.approx(2 * gpu.linear_seconds_per_byte(512))
    assert get_gpu("L40S").linear_seconds_per_byte(8) is None              # datasheets have no profile


def test_a_measured_profile_replaces_the_roofline_for_dense_models():
    spec = get_model("SmolLM2-135M")
    profiled = make_perf_model(spec, _profiled_cpu(), 1, 1, weight_dtype="fp32", kv_dtype="fp32",
                               gpus_per_node=1, compute_efficiency=1.0)
    roofline = make_perf_model(spec, _profiled_cpu(gemm_profile=()), 1, 1, weight_dtype="fp32",
                               kv_dtype="fp32", gpus_per_node=1, compute_efficiency=1.0)
    stage = profiled.stages[0]
    gpu = profiled.gpu
    # Decode, 8 rows: every weight byte at the 8-row rate, the head too (8 sampled rows), plus the
    # cache read, the attention arithmetic, the element-wise passes over the 8 rows' activations
    # and the kernel calls, added rather than overlapped.
    activations = 8 * stage.num_layers * (8 * spec.hidden_size + 4 * spec.intermediate_size) * 4 / gpu.hbm_bandwidth
    expected = ((stage.dense_read + stage.head) * 4 * gpu.linear_seconds_per_byte(8)
                + 8 * 300 * stage.kv_entries * 4 / gpu.hbm_bandwidth
                + 8 * 300 * profiled._attn_flops_per_ctx_token(stage) / gpu.attention_flops
                + activations + stage.num_layers * 12 * gpu.op_overhead_s)
    assert profiled.decode_step_time(8, 300) == pytest.approx(expected)
    assert profiled.decode_step_time(8, 300) > roofline.decode_step_time(8, 300)
    # The engine's measured fixed costs (CPU calibration) replace the per-call estimate.
    measured = make_perf_model(spec, _profiled_cpu(step_overhead_s=1e-3, layer_overhead_s=2e-4), 1, 1,
                               weight_dtype="fp32", kv_dtype="fp32", gpus_per_node=1, compute_efficiency=1.0)
    fixed = 1e-3 + stage.num_layers * 2e-4 - stage.num_layers * 12 * gpu.op_overhead_s
    assert measured.decode_step_time(8, 300) == pytest.approx(expected + fixed)
    # Prefill: the head computes one row, the body all 256.
    body = stage.dense_read * 4 * gpu.linear_seconds_per_byte(256)
    assert profiled.prefill_time(256) > body + stage.head * 4 * gpu.linear_seconds_per_byte(1)
    # The engine's decode kernel, measured (its cache reads included), replaces cache bytes over
    # bandwidth and FLOPs at the prefill rate for the decodes, and only for them.
    kernel = make_perf_model(spec, _profiled_cpu(decode_attention_flops=15e9), 1, 1, weight_dtype="fp32",
                             kv_dtype="fp32", gpus_per_node=1, compute_efficiency=1.0)
    attention = 8 * 300 * (stage.kv_entries * 4 / gpu.hbm_bandwidth
                           + profiled._attn_flops_per_ctx_token(stage) / gpu.attention_flops)
    measured_attention = 8 * 300 * profiled._attn_flops_per_ctx_token(stage) / 15e9
    assert kernel.decode_step_time(8, 300) == pytest.approx(expected - attention + measured_attention)
    assert kernel.prefill_time(256) == pytest.approx(profiled.prefill_time(256))
    mixed = (64, 64 * 65 / 2, 9, 8, 8 * 300)  # a 64-token prompt beside 8 decodes
    assert kernel.mixed_step_time(*mixed) == pytest.approx(
        profiled.mixed_step_time(*mixed) - attention + measured_attention)


def test_median_ttft_skips_the_queue_until_half_the_time_is_prefill():
    spec = get_model("SmolLM2-135M")
    perf = make_perf_model(spec, _profiled_cpu(), 1, 1, weight_dtype="fp32", kv_dtype="fp32",
                           gpus_per_node=1, compute_efficiency=1.0)
    work = Workload(256, 128)
    occupancy = perf.prefill_occupancy(256)
    light = operating_point(perf, 1000, work, 0.3 / occupancy)
    assert light.ttft_p50_s < light.ttft_s                  # the mean counts the queue, the median not
    assert light.ttft_s - light.ttft_p50_s == pytest.approx(light.queue_s)
    heavy = operating_point(perf, 1000, work, 0.8 / occupancy)
    assert light.ttft_p50_s < heavy.ttft_p50_s < heavy.ttft_s
    # A prefill step carries the decoding sequences' next tokens: at a low rate the inter-token
    # latency is the decode step itself, and it grows with the share of time spent prefilling.
    idle = operating_point(perf, 1000, work, 1e-6)
    assert idle.itl_s == pytest.approx(perf.decode_step_time(max(idle.concurrency, 1.0), 256 + 64), rel=1e-3)
    assert idle.itl_s < light.itl_s < heavy.itl_s
