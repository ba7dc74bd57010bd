"""The GPU KV budget: the arithmetic on a measured profile, the message when nothing is left, and the
worst steps the profile runs (their shape, and that forward and sampling run them on CPU)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: CPU tensors, no GPU

import pytest
import torch
from tiny_model import tiny_runner

from meshserve.layers.attention import backend_names, create_backend
from meshserve.sampling_params import MAX_LOGPROBS
from meshserve.worker.memory_budget import (
    GIB,
    DeviceMemoryProfile,
    decode_step,
    plan_kv_cache,
    profile_steps,
)
from meshserve.worker.step_packing import pack_step

MIB = 1 << 20


def test_the_kv_cache_gets_what_the_profile_leaves():
    profile = DeviceMemoryProfile(total_bytes=80 * GIB, weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB,
                                  non_torch_bytes=GIB, cuda_graph_bytes=GIB // 2, allocator_slack_bytes=GIB // 4)
    budget = plan_kv_cache(profile, 0.9, block_bytes=2 * MIB, spare_blocks=1)
    assert budget.usable_bytes == 72 * GIB
    assert budget.reserve_bytes == GIB // 2 + GIB // 4 + 2 * MIB
    assert budget.kv_bytes == 72 * GIB - 16 * GIB - 2 * GIB - GIB - (3 * GIB // 4) - 2 * MIB
    assert budget.num_blocks == budget.kv_bytes // (2 * MIB) == 26751
    text = budget.describe()
    for part in ("80.00 total x 0.9", "weights 16.00", "activation peak 2.00", "non-torch 1.00",
                 "CUDA graphs 0.50", "KV cache 52.25 = 26751 blocks"):
        assert part in text


def test_more_utilization_more_blocks_and_eager_needs_no_graph_reserve():
    base = dict(total_bytes=24 * GIB, weights_bytes=14 * GIB, activation_peak_bytes=GIB, non_torch_bytes=GIB // 2)
    eager = plan_kv_cache(DeviceMemoryProfile(**base), 0.9, MIB)
    graphs = plan_kv_cache(DeviceMemoryProfile(**base, cuda_graph_bytes=GIB // 4), 0.9, MIB, spare_blocks=1)
    assert eager.num_blocks - graphs.num_blocks == 256 + 1
    assert plan_kv_cache(DeviceMemoryProfile(**base), 0.95, MIB).num_blocks > eager.num_blocks


def test_no_room_names_what_to_change():
    profile = DeviceMemoryProfile(total_bytes=16 * GIB, weights_bytes=15 * GIB, activation_peak_bytes=GIB,
                                  non_torch_bytes=GIB // 2)
    with pytest.raises(ValueError, match="gpu_memory_utilization") as err:
        plan_kv_cache(profile, 0.9, MIB)
    assert "weights 15.00" in str(err.value)


@pytest.mark.parametrize("tokens,seqs,max_len", [(2048, 256, 4096), (8192, 256, 4096), (512, 1024, 8192), (64, 1, 32)])
def test_profile_steps_are_the_largest_the_scheduler_may_build(tokens, seqs, max_len):
    prefill, decode = profile_steps(tokens, seqs, max_len, block_size=16)
    for step in (prefill, decode):
        packed = pack_step(step, 16)
        assert packed.num_tokens <= tokens
        for s in step.seqs:
            assert s.start + len(s.token_ids) == max_len  # every sequence at full context
            assert s.sample and s.params.logprobs == MAX_LOGPROBS and s.params.has_penalties
            assert s.params.top_k > 0 and s.params.top_p < 1 and not s.params.greedy
            assert len(s.block_table) * 16 >= max_len
    assert pack_step(prefill, 16).num_tokens == tokens
    assert all(len(s.token_ids) <= max_len for s in prefill.seqs)
    rows = min(seqs, tokens)
    assert len(decode.seqs) == rows
    assert sum(len(s.token_ids) == 1 for s in decode.seqs) >= rows - 1
    assert pack_step(decode, 16).num_tokens == min(tokens, rows - 1 + max_len)


def test_decode_step_is_a_full_batch_at_full_context():
    step = decode_step(8, 64, 16)
    packed = pack_step(step, 16)
    assert packed.is_decode_only and packed.decode_context_lens == [64] * 8 and not packed.sample_rows


@pytest.mark.parametrize("backend", backend_names())
def test_the_profile_steps_run_through_forward_and_sampling(tmp_path, backend, monkeypatch):
    runner = tiny_runner(tmp_path, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=40, block_size=16)
    runner.attn_backend = create_backend(backend, runner.attn_backend.spec, runner.device)
    calls = []
    sample = runner.sample
    monkeypatch.setattr(runner, "sample", lambda step, rows: calls.append(sample(step, rows)))
    runner.run_profile_steps(runner._dummy_kv_cache())
    largest_prefill, largest_decode = calls
    assert len(largest_prefill.token_ids) == 1 and len(largest_decode.token_ids) == 6
    assert all(len(top) == MAX_LOGPROBS for _, top in largest_decode.logprobs)
    assert runner.sampler.seq_generators == {}
    assert all(torch.isfinite(c).all() for c in runner._dummy_kv_cache())


@pytest.mark.parametrize("engine_args", [{}, {"enable_chunked_prefill": False}, {"max_num_batched_tokens": 96}])
def test_the_profile_uses_the_token_budget_the_scheduler_gets(tmp_path, engine_args):
    from tiny_model import write_tiny_config

    from meshserve import LLM

    llm = LLM(str(write_tiny_config(tmp_path)), load_format="dummy", device="cpu", max_model_len=200,
              kv_cache_memory_bytes=1 << 20, **engine_args)
    assert llm.engine.max_num_batched_tokens == llm.engine.config.batched_token_budget(200)
    llm.engine.shutdown()
