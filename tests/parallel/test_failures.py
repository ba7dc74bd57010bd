"""A dead rank fails the engine loudly and quickly, and takes the other ranks down with it."""
import os
import signal
import time

import pytest
from parallel_helpers import ENGINE_ARGS, GREEDY, prompts

from meshserve import LLM, SamplingParams
from meshserve.engine import llm_engine
from meshserve.worker.executor import WorkerFailure
from meshserve.worker.mp_executor import STEP_ERROR_GRACE_S
from meshserve.worker.rank_messages import RankMethod


def test_killed_worker_fails_the_engine_within_seconds(tiny_kv2):
    llm = LLM(tiny_kv2, tensor_parallel_size=2, **ENGINE_ARGS)
    executor = llm.engine.executor
    try:
        executor.check_health()
        victim = executor.procs[1]
        killed_at, steps = [], []
        broadcast = executor._broadcast

        def broadcast_then_kill(method, *args):
            """The third step is sent to every rank, then rank 1 dies while the engine waits for it."""
            broadcast(method, *args)
            steps.append(method)
            if steps.count(RankMethod.EXECUTE) == 3:
                killed_at.append(time.monotonic())
                os.kill(victim.pid, signal.SIGKILL)

        executor._broadcast = broadcast_then_kill
        with pytest.raises(WorkerFailure, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL") as err:
            llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert err.value.rank == 1
        # Seen through the dead process's sentinel at once (then 0.3 s for the peers' replies, and the
        # others are stopped): well inside the grace a rank's step error gets (10 s), the slower way
        # the failure could have been noticed. That, not a few seconds a loaded machine may miss, is
        # the bound.
        assert time.monotonic() - killed_at[0] < STEP_ERROR_GRACE_S
        assert not any(p.is_alive() for p in executor.procs)  # the surviving rank was stopped too
        with pytest.raises(WorkerFailure, match="rank 1"):
            executor.check_health()
        with pytest.raises(WorkerFailure):
            llm.generate(["again"], SamplingParams(max_tokens=2))
    finally:
        llm.engine.shutdown()


def test_check_health_reports_a_rank_that_died_while_idle(tiny_kv2):
    llm = LLM(tiny_kv2, pipeline_parallel_size=2, **ENGINE_ARGS)
    executor = llm.engine.executor
    try:
        os.kill(executor.procs[0].pid, signal.SIGKILL)
        executor.procs[0].join(5)
        with pytest.raises(WorkerFailure, match=r"worker rank 0 .*SIGKILL"):
            executor.check_health()
        assert not executor.procs[1].is_alive()
    finally:
        llm.engine.shutdown()


def test_a_step_that_raises_on_every_rank_fails_only_its_requests(tiny_kv2, reference_kv2, monkeypatch):
    """All ranks raise in the same step (a block id outside the cache): every rank answers, so the
    executor is sound; the engine fails that step's requests and serves the next ones exactly."""
    llm = LLM(tiny_kv2, tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.engine
    try:
        real = llm_engine.build_step_input

        def corrupt(*args):
            step = real(*args)
            step.seqs[0].block_table = [10**6] * len(step.seqs[0].block_table)
            return step

        with monkeypatch.context() as patch:
            patch.setattr(llm_engine, "build_step_input", corrupt)
            out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=4))[0]
        assert out.outputs[0].finish_reason == "error" and "worker rank" in out.error
        assert all(p.is_alive() for p in engine.executor.procs)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)] == reference_kv2
    finally:
        engine.shutdown()


def test_interrupted_step_replies_are_drained_before_the_next_call(tiny_kv2, reference_kv2):
    llm = LLM(tiny_kv2, tensor_parallel_size=2, **ENGINE_ARGS)
    executor = llm.engine.executor
    try:
        gather = executor._gather
        calls = []

        def interrupted(*a, **k):
            calls.append(1)
            if len(calls) == 2:  # the second step: sent to every rank, the wait interrupted (Ctrl-C)
                raise KeyboardInterrupt
            return gather(*a, **k)

        executor._gather = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=8))
        executor._gather = gather
        assert executor._awaiting == {0, 1}
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)] == reference_kv2
    finally:
        llm.engine.shutdown()
