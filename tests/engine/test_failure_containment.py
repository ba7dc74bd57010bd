"""A step that raises fails only the requests in it; the engine, its KV pool and its prefix cache stay
sound, and `LLM` stays usable after any exception, KeyboardInterrupt included."""
from __future__ import annotations

import pytest

from meshserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(peaked_model):
    llm = LLM(peaked_model, max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_seqs=8)
    yield llm
    llm.engine.shutdown()


def _idle(llm) -> bool:
    bm = llm.engine.block_manager
    return not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


class _FailOnce:
    """Wraps executor.execute: the step whose batch contains `marker` (a prompt token) raises."""

    def __init__(self, engine, marker: int, exc: BaseException):
        self.engine, self.marker, self.exc = engine, marker, exc
        self.real = engine.executor.execute
        engine.executor.execute = self

    def __call__(self, step):
        if self.exc is not None and any(self.marker in s.token_ids for s in step.seqs):
            exc, self.exc = self.exc, None
            raise exc
        return self.real(step)

    def restore(self):
        self.engine.executor.execute = self.real


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(llm):
    prompt = list(range(3000, 3040))  # 2 full blocks + 8 tokens
    expected = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    llm.engine.block_manager.reset_prefix_cache()
    bystander = list(range(5000, 5010))
    engine = llm.engine
    fail = _FailOnce(engine, marker=3000, exc=RuntimeError("kernel exploded"))
    try:
        engine.add_request("bystander", bystander, GREEDY)
        engine.step()  # the bystander's prefill runs alone, before the doomed request arrives
        engine.add_request("doomed", prompt, GREEDY)
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
    finally:
        fail.restore()
    doomed = [d for d in deltas if d.request_id == "doomed"]
    assert len(doomed) == 1 and doomed[0].finished
    assert doomed[0].outputs[0].finish_reason == "error" and "kernel exploded" in doomed[0].error
    # The bystander was in the failed step too (decoding): it failed with it, nothing else did.
    assert [d.outputs[0].finish_reason for d in deltas if d.finished and d.request_id == "bystander"] == ["error"]
    assert _idle(llm)
    # The failed prefill registered nothing: the prompt's blocks are not in the prefix cache.
    assert engine.block_manager.cached == {}
    again = llm.generate([prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == expected and again.metrics.num_cached_prompt_tokens == 0


def test_llm_generate_reports_a_failed_request_and_keeps_the_others(llm):
    fail = _FailOnce(llm.engine, marker=4444, exc=ValueError("bad row"))
    try:
        outs = llm.generate([[4444, 1, 2, 3]], GREEDY)
    finally:
        fail.restore()
    assert outs[0].outputs[0].finish_reason == "error" and "bad row" in outs[0].error
    assert llm.generate([[10, 11, 12]], GREEDY)[0].outputs[0].finish_reason == "length"
    assert _idle(llm)


def test_llm_is_usable_after_keyboard_interrupt(llm):
    prompts = [list(range(6000, 6030)), list(range(7000, 7020))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    llm.engine.block_manager.reset_prefix_cache()
    fail = _FailOnce(llm.engine, marker=6000, exc=KeyboardInterrupt())
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY)
    finally:
        fail.restore()
    assert _idle(llm) and llm.engine.block_manager.cached == {}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
