"""Property test: any mix of valid sampling parameters in one batch through `LLM.generate`.

Every request ends with "stop" or "length" within its limits; greedy and seeded requests give
exactly what they give alone; and the KV pool is idle again afterwards."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampling_mixes import check_sample, examples, is_reproducible, prompt_batches, sampling_params

from meshserve import LLM


@pytest.fixture(scope="module")
def llm(peaked_model):
    llm = LLM(peaked_model, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=16,
              max_num_batched_tokens=64)  # small steps: prompts are chunked and mixed with decodes
    yield llm
    llm.engine.shutdown()


@settings(max_examples=examples(30), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_mix_of_sampling_parameters_in_one_batch(llm, data):
    prompts = data.draw(prompt_batches())
    params = [data.draw(sampling_params()) for _ in prompts]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, p, prompt in zip(outs, params, prompts):
        assert out.finished and out.error is None and len(out.outputs) == p.n
        for sample in out.outputs:
            check_sample(sample.token_ids, sample.text, sample.finish_reason, sample.stop_reason, p)
            if p.logprobs is not None:
                assert len(sample.logprobs) == len(sample.token_ids)
                assert all(tok in entry and len(entry) <= p.logprobs + 1
                           for tok, entry in zip(sample.token_ids, sample.logprobs))
        if is_reproducible(p):
            alone = llm.generate([prompt], p)[0]
            assert [s.token_ids for s in out.outputs] == [s.token_ids for s in alone.outputs]
            assert [s.text for s in out.outputs] == [s.text for s in alone.outputs]
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
