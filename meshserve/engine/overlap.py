"""Overlap scheduling (with `--async-scheduling`): step N+1 is scheduled and launched while step N's
forward still runs, as SGLang's overlap scheduler and vLLM's async scheduling do.

Every sequence that samples in step N and may go on is assumed to: its next token is *pending*
(`Sequence.token_pending`): the scheduler counts it, the block manager gives it a K/V slot (but
hashes no block holding it), and the rank gets a placeholder it replaces with the token it sampled
for the sequence in step N (`Worker._fill_pending`), so the engine never waits for that token to
build the step. A sequence found finished in step N (EOS, a stop token id) keeps its row in step
N+1, whose token is void (`LLMEngine._take_tokens` drops it). Its blocks return when its end is
known, while step N+1 may still write its slot: steps run in launch order on the one step thread,
so a block freed then is reused only by a later step. A sequence whose step-N token is its last by
length (max_tokens, max_model_len) is not carried: it leaves the scheduler with its blocks before
step N+1 is scheduled (`Scheduler.end_early`), so that step sees what it sees without overlap.

A step is overlapped only where that is safe (`overlap_blocker`); otherwise the next step is
scheduled once this one's tokens are in, as without overlap. Step N+1 runs only if step N
succeeded (`run_after`): when step N fails, its requests fail and step N+1's other sequences go
back to the queue to be computed again (a leased one fails: its lease cannot be drawn twice).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

from meshserve.engine.output import EngineRequest
from meshserve.engine.scheduler import SchedulerOutput
from meshserve.engine.sequence import Sequence, SequenceStatus
from meshserve.worker.executor import WorkerFailure
from meshserve.worker.step import StepInput, StepResult

if TYPE_CHECKING:
    from meshserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("meshserve")

# A launched step: its schedule, its result to come, when it was scheduled, its phase times so far.
Launched = tuple[SchedulerOutput, Future[StepResult], float, dict[str, float]]


class SkippedStep(RuntimeError):
    """The step was launched on one that failed, so it never ran."""

    def __init__(self, finished_seq_ids: list[int]) -> None:
        super().__init__("the step it was launched on failed")
        self.finished_seq_ids = finished_seq_ids  # still to be dropped by the ranks


def run_after(previous: Future[StepResult] | None, execute: Callable[[StepInput], StepResult],
              step: StepInput) -> StepResult:
    """Run on the step thread, which has run `previous` by then: a step never runs after a failed one,
    whose K/V and sampled tokens it may read."""
    if previous is not None and previous.exception() is not None:
        raise SkippedStep(step.finished_seq_ids)
    return execute(step)


def overlap_blocker(engine: LLMEngine, launched: Launched) -> str | None:
    """Why the step after `launched` may not be scheduled before `launched`'s tokens are known; None
    when it may. The one rule: every sequence it carries forward must need no decision on the host
    between its token being sampled and the next step being built."""
    sched, pending = launched[0], launched[1]
    if engine.kv is not None:
        return "a KV hand-off reads the cache between steps"
    if pending.done() and pending.exception() is not None:
        return "the step failed"
    carried = 0
    for seq in carried_forward(engine, sched):
        if engine.structured.constrained(seq):  # its next mask follows from the token
            return "a structured-output constraint"
        if engine.seq_to_request[seq.seq_id].samples[seq.index].stops:  # its text decides
            return "stop strings"
        carried += 1
    # Penalties need nothing: the sampling rank counts the tokens it draws (layers/sampler.py).
    return None if carried else "no sequence goes on"


def carried_forward(engine: LLMEngine, sched: SchedulerOutput) -> Iterator[Sequence]:
    """The sequences that sample in `sched` and may go on after it."""
    for item in sched.scheduled:
        seq = item.seq
        if item.completes and seq.status is SequenceStatus.RUNNING and not seq.length_reached(engine.max_model_len, 1):
            yield seq


class Overlap:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps_overlapped = 0

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> Overlap | None:
        if not engine.config.async_scheduling:
            return None
        reason = engine.executor.no_pending_tokens
        if reason is not None:
            logger.info("overlap scheduling is off (%s): each step is scheduled once the last one's tokens "
                        "are in", reason)
            return None
        return cls(engine)

    def launch_next(self, launched: Launched) -> Launched | None:
        """Schedule and launch the step after `launched` now, where that is safe (else None: it is
        scheduled once `launched`'s tokens are in)."""
        engine = self.engine
        why = overlap_blocker(engine, launched)
        if why is not None:
            logger.debug("the next step waits for this one's tokens: %s", why)
            return None
        carried = set(carried_forward(engine, launched[0]))
        for item in launched[0].scheduled:  # what the step does whatever its tokens
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
            if seq in carried:
                seq.token_pending = True
            elif item.completes:  # its last token, by length
                engine.scheduler.end_early(seq)
        following = engine._launch(after=launched[1])
        self.steps_overlapped += following is not None
        return following

    def drop(self, launched: Launched) -> list[EngineRequest]:
        """`launched` was launched on a step that failed, so it never runs: its sequences that are not
        finished (those of that step are) go back to the queue. Returns the requests to fail instead:
        those of leased sequences, whose lease has been drawn on."""
        engine = self.engine
        try:
            launched[1].result()
        except SkippedStep as exc:
            engine._finished_seq_ids[:0] = exc.finished_seq_ids
        except WorkerFailure:
            raise
        except Exception:  # it failed while being built: nothing ran either
            pass
        fail: dict[str, EngineRequest] = {}
        for item in reversed(launched[0].scheduled):  # requeued at the head, in their order
            seq = item.seq
            if seq.is_finished:
                continue
            seq.token_pending = False
            if seq.lease is not None:
                state = engine.seq_to_request[seq.seq_id]
                fail[state.request_id] = state
                continue
            seq.sampler_has_history = False  # the history it may have carried was never loaded
            engine.scheduler.requeue(seq)
        return list(fail.values())
