"""Async scheduling (--async-scheduling): the next step is scheduled and launched while the current
one's text is rendered. Any mix of sampling parameters gives exactly what the same engine gives
without it (tokens, text, finish reasons, logprobs), steps really do overlap, and a request aborted
while its step runs ends cleanly with every block back."""
from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampling_mixes import examples, prompt_batches, sampling_params

from meshserve import LLM
from meshserve.sampling_params import SamplingParams

ARGS = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=16, max_num_batched_tokens=64, seed=0)


@pytest.fixture(scope="module")
def pair(peaked_model):
    sync, overlapped = LLM(peaked_model, **ARGS), LLM(peaked_model, async_scheduling=True, **ARGS)
    yield sync, overlapped
    sync.engine.shutdown()
    overlapped.engine.shutdown()


def _view(outs):
    return [[(s.token_ids, s.text, s.finish_reason, s.stop_reason, s.logprobs) for s in o.outputs] for o in outs]


@settings(max_examples=examples(20), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_mix_gives_what_the_synchronous_engine_gives(pair, data):
    sync, overlapped = pair
    prompts = data.draw(prompt_batches())
    params = [data.draw(sampling_params()) for _ in prompts]
    # Each engine starts from the same sampler state: a fresh seed per batch where no seed is given.
    assert _view(overlapped.generate(prompts, params)) == _view(sync.generate(prompts, params))
    for llm in pair:
        bm = llm.engine.block_manager
        assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_the_next_step_is_launched_before_the_last_one_is_rendered(pair, monkeypatch):
    """While the engine renders step k's text, step k+1 is already launched and not done: each
    step waits (on the step thread) until the previous one's text has been rendered."""
    _, overlapped = pair
    engine = overlapped.engine
    rendered = threading.Event()
    rendered.set()
    overlaps = []
    real_execute, real_deltas = engine.executor.execute, engine._deltas

    def execute(step):
        assert rendered.wait(30)
        rendered.clear()
        return real_execute(step)

    def deltas(touched):
        overlaps.append(engine._inflight is not None and not engine._inflight[1].done())
        rendered.set()
        return real_deltas(touched)

    monkeypatch.setattr(engine.executor, "execute", execute)
    monkeypatch.setattr(engine, "_deltas", deltas)
    overlapped.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert overlaps == [True] * 11 + [False]  # every step but the last ran while its predecessor rendered


def test_abort_while_its_step_runs(pair):
    sync, overlapped = pair
    engine = overlapped.engine
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("keep", [11, 12, 13, 14], greedy)
    engine.add_request("drop", [21, 22, 23], greedy)
    engine.step()
    assert engine._inflight is not None  # the second step is running now
    engine.abort_request("drop")
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    kept = [t for d in deltas if d.request_id == "keep" for s in d.outputs for t in s.token_ids]
    assert all(d.request_id != "drop" or d.finished for d in deltas)
    alone = sync.generate([[11, 12, 13, 14]], greedy)[0].outputs[0].token_ids
    assert kept == alone[len(alone) - len(kept):]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_async_scheduling_refuses_a_kv_role():
    from meshserve.config import EngineConfig
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="default", async_scheduling=True, kv_role="decode")
