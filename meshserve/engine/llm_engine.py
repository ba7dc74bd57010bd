"""LLMEngine: step() = schedule -> execute -> sample -> update. The only loop.

The engine owns requests, the scheduler and the block manager; the executor owns the model ranks.
Each request with n samples becomes n sequences that share the prompt (and its cached blocks).
"""
from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from meshserve.config import EngineConfig
from meshserve.engine.answers import CallAnswers
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.messages import ErrorCode, RequestDelta
from meshserve.engine.output import EngineRequest
from meshserve.engine.overlap import Launched, Overlap, run_after
from meshserve.engine.reservations import LeaseDesk
from meshserve.engine.scheduler import Scheduler, SchedulerOutput
from meshserve.engine.sequence import Sequence, SequenceStatus
from meshserve.engine.step_cost import StepCostModel
from meshserve.engine.step_input import build_step_input
from meshserve.engine.step_thread import make_step_thread
from meshserve.engine.step_timeline import StepTimeline, step_shape
from meshserve.kv_transfer.connector import KVConnector, make_connector
from meshserve.models.loader import resolve_model
from meshserve.sampling_params import SamplingParams
from meshserve.structured.matchers import StructuredOutputs
from meshserve.tokenizer import Tokenizer
from meshserve.worker.executor import WorkerFailure
from meshserve.worker.factory import make_executor
from meshserve.worker.step import StepResult

if TYPE_CHECKING:
    from meshserve.layers.sampler import SamplerOutput

logger = logging.getLogger("meshserve")


class LLMEngine(CallAnswers):
    def __init__(self, config: EngineConfig):
        self.source = resolve_model(config.model, config.load_format)
        config = replace(config, quantization=self.source.quantization_for(config.quantization,
                                                                           config.tensor_parallel_size))
        self.config = config
        mcfg = self.source.config
        self.tokenizer: Tokenizer = (Tokenizer.from_hf_dir(config.tokenizer) if config.tokenizer
                                     else self.source.load_tokenizer())
        # The model's embedding bounds every token id, whatever the tokenizer can produce.
        self.vocab_size = mcfg.vocab_size
        if self.tokenizer.vocab_size > mcfg.vocab_size:
            what = (f"the tokenizer's vocabulary ({self.tokenizer.vocab_size} tokens) is larger than the "
                    f"model's embedding ({mcfg.vocab_size})")
            if config.tokenizer or self.source.has_own_tokenizer:
                raise ValueError(f"{what}: they do not belong together; give the model's own tokenizer")
            logger.warning("%s: prompts whose ids fall outside the model's vocabulary are refused", what)
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context "
                             f"({mcfg.max_position_embeddings})")
        self.max_num_batched_tokens = config.batched_token_budget(self.max_model_len)
        if not config.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len})")
        self.eos_token_ids = tuple(mcfg.eos_token_id) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.executor = make_executor(config, self.source, self.max_model_len)
        num_blocks = self.executor.num_kv_blocks()
        need = -(-self.max_model_len // config.block_size)
        if num_blocks < need:
            self.executor.shutdown()
            raise ValueError(f"the KV cache holds {num_blocks} blocks of {config.block_size} tokens, fewer than "
                             f"the {need} one sequence of max_model_len={self.max_model_len} needs: raise "
                             "kv_cache_memory_bytes (or gpu_memory_utilization) or lower max_model_len")
        self.executor.init_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          extra_hash_key=self.source.revision)
        self.step_cost = StepCostModel() if config.decode_stall_ratio else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.prefill_chunk_with_decodes or None,
                                   self.step_cost, config.decode_stall_ratio)
        self.requests: dict[str, EngineRequest] = {}
        self._ended_between_steps: list[RequestDelta] = []
        self.desk = LeaseDesk(self.block_manager, self.max_model_len, lambda rid: rid in self.requests)
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.seq_to_request: dict[int, EngineRequest] = {}
        self._finished_seq_ids: list[int] = []
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.last_step_compute_s = self.last_step_comm_s = 0.0
        self.timeline = StepTimeline(config.step_trace)
        # Async scheduling: the next step runs on this thread while the engine renders the last one.
        self._step_thread = make_step_thread() if config.async_scheduling else None
        self._inflight: Launched | None = None
        self._last_step_done = 0.0  # a step launched before (overlap scheduling) starts no earlier
        # The ranks' timing and expert counts as of the last step (get_stats must not read them mid-step).
        self._executor_stats: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
        self.kv: KVConnector | None = make_connector(config, self.executor, self.block_manager, self.source,
                                                     self.tokenizer)
        # With async scheduling on one rank, the next step is even scheduled during the forward (engine/overlap.py).
        self._overlap = Overlap.for_engine(self)
        kv_tokens = num_blocks * config.block_size
        logger.info("model %s (revision %s): %d blocks x %d tokens = %d KV tokens (%.2f GiB per rank); "
                    "max_model_len %d, so at most %.2fx concurrency at full length",
                    self.source.model_id, self.source.revision, num_blocks, config.block_size, kv_tokens,
                    num_blocks * self.executor.block_bytes() / 2**30, self.max_model_len,
                    kv_tokens / self.max_model_len)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, lease_id: str | None = None, lease_owner: str = "",
                    cache_salt: str = "", kv_transfer: dict[str, Any] | None = None,
                    final_only: bool = False) -> list[int]:
        """Queue a request; returns its prompt token ids. ValueError (naming the problem) for a
        request the engine cannot serve: nothing is queued then. With `lease_id` the request draws
        on that reservation of `lease_owner`'s (and is never preempted); the lease ends when the
        request does. `cache_salt`: its prefix-cache scope (hits only on blocks of the same salt).
        `kv_transfer`: the descriptor of a hand-off to a decode engine (kv_transfer/connector.py).
        `final_only`: its output comes in one delta, when it ends (EngineRequest.final_only)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}] (the model's vocabulary)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
                             f"({self.max_model_len}) to leave room for at least one generated token")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        constraint = params.structured_outputs
        # The ranks sample constrained rows by the mask each step carries: they need no constraint.
        seq_params = replace(params, structured_outputs=None) if constraint is not None else params
        seqs = [Sequence(request_id, i, ids, seq_params, arrival, cache_salt) for i in range(params.n)]
        if kv_transfer is not None:
            if self.kv is None or params.n != 1:
                raise ValueError("kv_transfer_params needs an engine started with --kv-role prefill, and n = 1")
            self.kv.start_send(request_id, seqs[0], kv_transfer)
        if lease_id is not None:
            self.desk.reconcile()
            max_new = min(params.max_tokens, self.max_model_len - len(ids)) if params.max_tokens is not None \
                else self.max_model_len - len(ids)
            self.block_manager.bind(lease_id, request_id, seqs, max_new, lease_owner)
        state = EngineRequest(request_id, ids, params, self.tokenizer, arrival, seqs, final_only)
        state.lease_id = lease_id
        state.eos_token_ids = () if params.ignore_eos else self.eos_token_ids
        if constraint is not None:  # scheduled once its parsers are compiled (off the step loop)
            self.structured.hold(state, constraint)
        self.requests[request_id] = state
        for s in seqs:
            self.seq_to_request[s.seq_id] = state
            if constraint is None:
                self.scheduler.add(s)
            else:
                s.status = SequenceStatus.HELD
        return ids

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks; a no-op for an unknown id."""
        state = self.requests.get(request_id)
        if state is not None:
            self._finish_request(state, "abort")

    def has_unfinished_requests(self) -> bool:
        if self._inflight is not None or self._ended_between_steps:
            return True
        if self.kv is None:
            return bool(self.requests)
        # Requests waiting only for a hand-off's ack move when the connector has news.
        return len(self.requests) > self.kv.waiting_requests or self.kv.has_news()

    def _abort_with_error(self, state: EngineRequest, why: str, code: ErrorCode) -> None:
        """End a request the engine stops itself; its last delta (with why) goes out with the next step."""
        state.error, state.error_code = why, code
        self._finish_request(state, "abort")
        if (delta := state.take_delta()) is not None:
            self._ended_between_steps.append(delta)

    def _finish_request(self, state: EngineRequest, reason: str) -> None:
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
        state.finish_all(reason)
        self._retire(state, time.monotonic())

    def _retire(self, state: EngineRequest, now: float) -> None:
        state.metrics.finished_time = now
        if self.kv is not None:
            self.kv.request_ended(state.request_id)
        del self.requests[state.request_id]
        if state.params.structured_outputs is not None:
            self.structured.release(state)
        if state.lease_id is not None:  # completion, abort or failure: the lease ends with it
            self.block_manager.release(state.lease_id)
        for seq in state.seqs:
            self.seq_to_request.pop(seq.seq_id, None)
            self._finished_seq_ids.append(seq.seq_id)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One model step over what the scheduler picks; returns what each touched request gained,
        after the last deltas of requests the engine ended between steps (a released lease).

        A step that raises (a bug, a kernel error, out of memory) fails only the requests in it, with
        finish_reason "error"; its blocks are freed and none of them stays in the prefix cache. A dead
        rank (WorkerFailure) is not contained: the executor is gone, so the engine is too."""
        if self.kv is not None:
            self._poll_handoffs()
        ended, self._ended_between_steps = self._ended_between_steps, []
        return ended + self._admit_constrained() + self._step()

    def _admit_constrained(self) -> list[RequestDelta]:
        """Constrained requests whose parsers are compiled join the scheduler (one whose constraint
        failed to compile ends with why). With nothing else to run, wait briefly for a compile."""
        if not self.structured.holding:
            return []
        idle = not self.scheduler.has_unfinished()
        failed = []
        for state, why in self.structured.ready(wait_s=0.05 if idle else 0.0):
            if why is not None:
                state.error, state.error_code = why, ErrorCode.STEP_FAILED
                self._finish_request(state, "error")
                if (delta := state.take_delta()) is not None:
                    failed.append(delta)
                continue
            for seq in state.seqs:
                self.scheduler.add(seq)
        return failed

    def _step(self) -> list[RequestDelta]:
        launched, self._inflight = self._inflight or self._launch(), None
        if launched is None:
            return []
        if self._overlap is not None:
            self._inflight = self._overlap.launch_next(launched)
        sched, pending, now, phases = launched
        t2 = max(phases.pop("started"), self._last_step_done)  # when the ranks got the step
        try:
            result = pending.result()
        except WorkerFailure:
            raise
        except Exception as exc:
            return self._fail_step(sched, exc)
        except BaseException:  # KeyboardInterrupt: the caller aborts its requests
            self._inflight = None
            self.block_manager.rollback_step()
            raise
        t3 = self._last_step_done = time.perf_counter()
        self.block_manager.commit_step()
        if self.kv is not None:
            self.kv.after_step(sched.scheduled)
        self.last_step_compute_s = result.compute_s
        self.last_step_comm_s = sum(result.comm_s.values())
        self._executor_stats = self.executor.timing_snapshot(), self.executor.expert_load_snapshot()
        touched = self._take_tokens(sched, result.sampled)
        if self._step_thread is not None and self._inflight is None:  # runs while this step's text is rendered
            self._inflight = self._launch()
        deltas = self._deltas(touched)
        sample_s = max((t.sample_s for t in result.rank_timings), default=0.0)
        shape = step_shape(sched) if self.step_cost or self.config.step_trace else None
        if self.step_cost and shape:
            self.step_cost.observe(shape, t3 - t2)
        self.timeline.record({**phases, "forward": t3 - t2 - sample_s, "sample": sample_s,
                              "output": time.perf_counter() - t3}, now, shape if self.config.step_trace else None)
        return deltas

    def _launch(self, after: Future[StepResult] | None = None) -> Launched | None:
        """Schedule a step and start it: on the step thread with async scheduling (after the step
        `after`, if that succeeds), else run it here. Its result (or what it raised) is the future's."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        self.block_manager.launch_step()
        now = time.monotonic()
        for item in sched.scheduled:
            m = self.seq_to_request[item.seq.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        t1 = time.perf_counter()
        pending: Future[StepResult] = Future()
        try:
            finished, self._finished_seq_ids = self._finished_seq_ids, []
            step_input = build_step_input(sched, self.structured, finished)
            t2 = time.perf_counter()
            if self._step_thread is not None:
                pending = self._step_thread.submit(run_after, after, self.executor.execute, step_input)
            else:
                pending.set_result(self.executor.execute(step_input))
        except WorkerFailure:
            raise
        except Exception as exc:
            pending.set_exception(exc)
            t2 = time.perf_counter()
        except BaseException:
            self.block_manager.rollback_step()
            raise
        return sched, pending, now, {"schedule": t1 - t0, "prepare": t2 - t1, "started": t2}

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        logger.error("an engine step failed (%s: %s); failing the %d request(s) in it",
                     type(exc).__name__, exc, len({i.seq.request_id for i in sched.scheduled}),
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        self.block_manager.rollback_step()  # and that of the step launched on it, which never runs
        failed = {self.seq_to_request[i.seq.seq_id].request_id: self.seq_to_request[i.seq.seq_id]
                  for i in sched.scheduled if not i.seq.is_finished}
        if self._overlap is not None and self._inflight is not None:  # launched on it (overlap scheduling)
            failed.update((state.request_id, state) for state in self._overlap.drop(self._inflight))
        self._inflight = None
        deltas = []
        for state in failed.values():
            state.error = f"the engine step failed: {type(exc).__name__}: {exc}"
            state.error_code = ErrorCode.STEP_FAILED
            self._finish_request(state, "error")
            if (delta := state.take_delta()) is not None:  # always: its finish has not gone out yet
                deltas.append(delta)
        return deltas

    def _take_tokens(self, sched: SchedulerOutput, sampled: SamplerOutput | None) -> list[EngineRequest]:
        """Each sequence's new token and whether it ends there: all the next step's schedule needs."""
        now = time.monotonic()
        touched: dict[str, EngineRequest] = {}
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            seq.token_pending = False
            if seq.is_finished:  # aborted while its step ran, or ended the step before (overlap): void
                row += item.completes
                continue
            if seq.status is SequenceStatus.RUNNING:  # else preempted while its step ran (overlap)
                seq.num_computed_tokens = item.start + item.num_tokens
            if not item.completes:
                continue
            state = self.seq_to_request[seq.seq_id]
            assert sampled is not None, "the executor samples in every step that completes a sequence"
            self._append_token(state, seq, sampled.token_ids[row], sampled.logprobs[row], now)
            row += 1
            touched[state.request_id] = state
        return list(touched.values())

    def _deltas(self, touched: list[EngineRequest]) -> list[RequestDelta]:
        now = time.monotonic()
        deltas = []
        for state in touched:
            if state.final_only and not state.finished:
                continue
            delta = state.take_delta()
            if state.finished and delta is not None and self.kv is not None \
                    and self.kv.hold_finished(state.request_id, state, delta):
                continue  # its last output goes out when decode has the K/V (_handed_off)
            if delta is not None:
                deltas.append(delta)
            if state.finished:
                self._retire(state, now)
        return deltas

    def _append_token(self, state: EngineRequest, seq: Sequence, token: int,
                      lp: tuple[float, list[tuple[int, float]]] | None, now: float) -> None:
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.num_prompt_tokens += len(state.prompt_ids)
            m.num_cached_prompt_tokens = max(0, seq.num_cached_tokens)
        m.last_token_time = now
        p = seq.params
        reason, stop_reason = None, None
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and (token in p.stop_ids or token in state.eos_token_ids):
            reason, stop_reason = "stop", (token if token in p.stop_ids else None)
        elif self.structured.constrained(seq) and self.structured.advance(seq, token):
            reason = "stop"  # the output is complete: its constraint admits no more tokens
        elif seq.length_reached(self.max_model_len):
            reason = "length"
        sample = state.samples[seq.index]
        if sample.stops:  # its text decides whether it stops: rendered before the next step is scheduled
            sample.append(token, lp, final=reason is not None, check_stops=may_stop)
        else:
            sample.push(token, lp)
        if reason is not None:
            sample.finish(reason, stop_reason)
        if sample.finish_reason is not None:  # it finished, with this token or a stop string in its text
            self.scheduler.finish(seq, sample.finish_reason, sample.stop_reason)

    def shutdown(self) -> None:
        if self.config.profile and self.timeline.steps:
            print(self.timeline.table(), file=sys.stderr)
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self.timeline.close()
        self.structured.close()
        if self.kv is not None:
            self.kv.close()
        self.executor.shutdown()

