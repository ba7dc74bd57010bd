"""LLMEngine: step() = schedule -> execute -> sample -> update. The only loop.

The engine owns requests, the scheduler and the block manager; the executor owns the model ranks.
Each request with n samples becomes n sequences that share the prompt (and its cached blocks).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from meshserve.config import EngineConfig
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from meshserve.engine.scheduler import Scheduler, SchedulerOutput
from meshserve.engine.sequence import Sequence
from meshserve.engine.step import SeqStep, StepInput
from meshserve.models.loader import resolve_model
from meshserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from meshserve.sampling_params import SamplingParams
from meshserve.tokenizer import Tokenizer
from meshserve.worker.executor import make_executor

logger = logging.getLogger("meshserve")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    last_step_compute_s: float = 0.0
    last_step_comm_s: float = 0.0
    # Per-rank compute/communication seconds (last step and totals): Executor.timing_snapshot().
    parallel_timing: dict = field(default_factory=dict)
    # MoE models: tokens routed to each expert of each layer ({} for dense): Executor.expert_load_snapshot().
    expert_load: dict = field(default_factory=dict)


class _RequestState:
    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], detoks: list[IncrementalDetokenizer], arrival: float):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.seqs, self.detoks = seqs, detoks
        self.outputs = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                        for i in range(len(seqs))]
        self.metrics = RequestMetrics(arrival_time=arrival)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def snapshot(self) -> RequestOutput:
        outs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                                 list(o.logprobs) if o.logprobs is not None else None) for o in self.outputs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outs, self.finished, self.metrics)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.source = resolve_model(config.model, config.load_format)
        mcfg = self.source.config
        self.tokenizer: Tokenizer = (Tokenizer.from_hf_dir(config.tokenizer) if config.tokenizer
                                     else self.source.load_tokenizer())
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's context "
                             f"({mcfg.max_position_embeddings})")
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            2048 if config.enable_chunked_prefill else max(2048, self.max_model_len))
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
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.requests: dict[str, _RequestState] = {}
        self.seq_to_request: dict[int, _RequestState] = {}
        self._finished_seq_ids: list[int] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_step_compute_s = 0.0
        self.last_step_comm_s = 0.0
        kv_tokens = num_blocks * config.block_size
        logger.info("model %s (revision %s): %d blocks x %d tokens = %d KV tokens (%.2f GiB per rank); "
                    "max_model_len %d, so at most %.2fx concurrency at full length",
                    self.source.model_id, self.source.revision, num_blocks, config.block_size, kv_tokens,
                    num_blocks * self.executor_block_bytes() / 2**30, self.max_model_len,
                    kv_tokens / self.max_model_len)

    def executor_block_bytes(self) -> int:
        runner = getattr(self.executor, "runner", None)
        return runner.block_bytes if runner is not None else self.executor.block_bytes()

    @property
    def model_info(self) -> dict:
        return {"id": self.config.served_model_name or self.source.model_id,
                "max_model_len": self.max_model_len, "revision": self.source.revision}

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            vocab = self.source.config.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
                             f"({self.max_model_len}) to leave room for at least one generated token")
        params._eos_token_ids = () if params.ignore_eos else self.eos_token_ids
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(request_id, i, ids, params, arrival) for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) for _ in seqs]
        state = _RequestState(request_id, text, ids, params, seqs, detoks, arrival)
        self.requests[request_id] = state
        for s in seqs:
            self.seq_to_request[s.seq_id] = state
            self.scheduler.add(s)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq, out in zip(state.seqs, state.outputs):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                out.finish_reason = "abort"
            self._forget(seq)
        state.metrics.finished_time = time.monotonic()
        return state.snapshot()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _forget(self, seq: Sequence) -> None:
        self.seq_to_request.pop(seq.seq_id, None)
        self._finished_seq_ids.append(seq.seq_id)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        step_input = self._step_input(sched)
        now = time.monotonic()
        for item in sched.scheduled:
            m = self.seq_to_request[item.seq.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        result = self.executor.execute(step_input)
        self.last_step_compute_s = result.compute_s
        self.last_step_comm_s = sum(result.comm_s.values())
        return self._update(sched, result.sampled)

    def _step_input(self, sched: SchedulerOutput) -> StepInput:
        seqs = []
        for item in sched.scheduled:
            seq = item.seq
            sample = item.completes
            p = seq.params
            seqs.append(SeqStep(
                seq.seq_id, seq.token_ids[item.start:item.start + item.num_tokens], item.start,
                list(seq.block_table), sample, p if sample else None,
                seed_key=(hash((p.seed, seq.index)) & 0x7FFFFFFF) if p.seed is not None else 0,
                history=(seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids)
                if sample and p.has_penalties else None))
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return StepInput(seqs, finished)

    def _update(self, sched: SchedulerOutput, sampled) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_tokens
            if not item.completes:
                continue
            token = sampled.token_ids[row]
            lp = sampled.logprobs[row]
            row += 1
            state = self.seq_to_request[seq.seq_id]
            self._append_token(state, seq, token, lp, now)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
                for s in state.seqs:
                    self._forget(s)
            outputs.append(state.snapshot())
        return outputs

    def _append_token(self, state: _RequestState, seq: Sequence, token: int, lp, now: float) -> None:
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.num_prompt_tokens += len(state.prompt_ids)
            m.num_cached_prompt_tokens = max(0, seq.num_cached_tokens)
        m.last_token_time = now
        out = state.outputs[seq.index]
        out.token_ids.append(token)
        if lp is not None:
            chosen, top = lp
            entry = dict(top)
            entry[token] = chosen
            out.logprobs.append(entry)
        detok = state.detoks[seq.index]
        delta = detok.add(token)
        p = seq.params
        reason, stop_reason = None, None
        if seq.num_output_tokens >= p.min_tokens and (token in p.stop_token_ids or token in p._eos_token_ids):
            reason, stop_reason = "stop", (token if token in p.stop_token_ids else None)
        elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            delta += detok.flush()
        text = detok.text
        if p.stop and delta and seq.num_output_tokens >= p.min_tokens:
            hit = find_stop(text, len(delta), p.stop)
            if hit is not None:
                i, s = hit
                text = text[:i + len(s)] if p.include_stop_str_in_output else text[:i]
                reason, stop_reason = "stop", s
        out.text = text
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop_reason
            self.scheduler.finish(seq, reason, stop_reason)

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.usage, bm.prefix_queries,
                           bm.prefix_hits, self.num_prompt_tokens, self.num_generation_tokens,
                           self.scheduler.num_preemptions, bm.num_free_blocks, bm.num_blocks,
                           self.last_step_compute_s, self.last_step_comm_s,
                           parallel_timing=self.executor.timing_snapshot(),
                           expert_load=self.executor.expert_load_snapshot())

    def shutdown(self) -> None:
        self.executor.shutdown()
