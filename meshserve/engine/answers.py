"""The questions an engine answers between steps (leases; KV hand-offs, whose transfers
meshserve/kv_transfer/connector.py does), and how a prefill request whose hand-off ended leaves
the engine."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from meshserve.engine.block_manager import ReservationError
from meshserve.engine.messages import (
    EngineStats,
    ErrorCode,
    KVPrepare,
    LeaseInfo,
    LeaseLedger,
    LeaseRef,
    ModelInfo,
    RequestDelta,
    ReserveRequest,
)
from meshserve.engine.protocol import UnsupportedCall
from meshserve.kv_transfer.sender import SendResult

if TYPE_CHECKING:
    from meshserve.config import EngineConfig
    from meshserve.engine.block_manager import BlockManager
    from meshserve.engine.output import EngineRequest
    from meshserve.engine.reservations import LeaseDesk
    from meshserve.engine.scheduler import Scheduler
    from meshserve.engine.step_timeline import StepTimeline
    from meshserve.kv_transfer.connector import KVConnector
    from meshserve.models.loader import ModelSource
    from meshserve.worker.executor import Executor


class CallAnswers:
    """Mixed into LLMEngine, whose parts it uses:"""
    if TYPE_CHECKING:
        kv: KVConnector | None
        requests: dict[str, EngineRequest]
        desk: LeaseDesk
        _ended_between_steps: list[RequestDelta]
        config: EngineConfig
        source: ModelSource
        executor: Executor
        block_manager: BlockManager
        scheduler: Scheduler
        timeline: StepTimeline
        max_model_len: int
        vocab_size: int
        num_prompt_tokens: int
        num_generation_tokens: int
        last_step_compute_s: float
        last_step_comm_s: float
        _executor_stats: tuple[dict[str, Any], dict[str, Any]]

        def _abort_with_error(self, state: EngineRequest, why: str, code: ErrorCode) -> None: ...

        def _retire(self, state: EngineRequest, now: float) -> None: ...

    def _poll_handoffs(self) -> None:
        assert self.kv is not None
        self.desk.reconcile()  # a lease that ended takes its hand-off along
        self.kv.poll(self._handed_off)

    def _handed_off(self, state: EngineRequest | None, delta: RequestDelta | str,
                    result: SendResult) -> None:
        """A hand-off ended: the held request's last output goes out, with its figures or why it failed."""
        if state is None:  # it failed while the prompt still ran
            if (running := self.requests.get(str(delta))) is not None:
                self._abort_with_error(running, f"the KV hand-off failed: {result.error}", ErrorCode.KV_TRANSFER_FAILED)
            return
        assert isinstance(delta, RequestDelta)
        delta.kv_transfer = {"transfer_id": result.transfer_id, "num_bytes": result.num_bytes,
                             "seconds": round(result.seconds, 6), "error": result.error}
        if result.error is not None:
            delta.error, delta.error_code = f"the KV hand-off failed: {result.error}", ErrorCode.KV_TRANSFER_FAILED
            for out in delta.outputs:
                out.finish_reason = "error"
        self._retire(state, time.monotonic())
        self._ended_between_steps.append(delta)

    def kv_prepare(self, req: KVPrepare) -> dict[str, Any] | None:
        """A decode engine's descriptor for a hand-off under the owner's lease (None: no room now)."""
        if self.kv is None:
            raise UnsupportedCall("this engine was not started with --kv-role decode")
        self.desk.reconcile()
        try:
            return self.kv.prepare(req.lease_id, req.owner, req.prompt_token_ids, req.request_id, req.attempt_id)
        except LookupError as exc:
            raise ReservationError(str(exc)) from None

    def kv_abort(self, transfer_id: str) -> bool:
        """Abort a hand-off on this leg (idempotent); a prefill request sending it ends with why."""
        if self.kv is None:
            return False
        running = self.kv.request_for(transfer_id)
        found = self.kv.abort(transfer_id)
        if running is not None and running in self.requests:
            self._abort_with_error(self.requests[running], "its KV hand-off was aborted", ErrorCode.KV_TRANSFER_FAILED)
        return found

    def reserve(self, req: ReserveRequest) -> LeaseInfo | None:
        """Grant a lease for `req` against the blocks not held back already, or None."""
        return self.desk.reserve(req)

    def release_lease(self, ref: LeaseRef) -> bool:
        """End the owner's lease; a request drawing on it is stopped and told why."""
        owned, running = self.desk.holder(ref)
        if not owned:
            return False
        if running is not None:
            self._abort_with_error(self.requests[running], f"its KV reservation {ref.lease_id} was released",
                                   ErrorCode.RESERVATION_RELEASED)
        self.desk.release(ref.lease_id)
        return True

    def leases(self, owner: str = "") -> LeaseLedger:
        return self.desk.ledger(owner)

    # ---- the loop's questions: who the engine is, its figures, its health ----------------------
    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(self.config.served_model_name or self.source.model_id, self.max_model_len,
                         self.source.revision, self.vocab_size)

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config.to_dict())

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        sched = self.scheduler
        pending = sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting) + sum(
            s.num_tokens - s.num_computed_tokens for s in sched.running if s.num_computed_tokens < s.num_prompt_tokens)
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_prompt_tokens=self.num_prompt_tokens, num_generation_tokens=self.num_generation_tokens,
            num_preemptions=sched.num_preemptions, num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            reserved_blocks=bm.reserved_blocks, held_back_blocks=bm.held_back, num_leases=len(bm.leases),
            pending_prefill_tokens=pending, block_size=bm.block_size, last_step_compute_s=self.last_step_compute_s,
            last_step_comm_s=self.last_step_comm_s, parallel_timing=self._executor_stats[0],
            expert_load=self._executor_stats[1], step_phases=dict(self.timeline.last),
            kv_transfer=self.kv.stats() if self.kv is not None else {})

    def check_health(self) -> None:
        """Raise (WorkerFailure) if a rank is gone, even while no request is running."""
        self.executor.check_health()

    def health_watch(self) -> tuple[list[int], float | None]:
        """What an idle engine process waits on besides its inbox: rank sentinels, and how often to
        call check_health when there are none to wait on."""
        watch = self.executor.sentinels(), self.executor.health_check_interval
        return watch if self.kv is None else self.kv.watch(*watch)

    def record_ipc(self, seconds: float) -> None:
        self.timeline.add("ipc", seconds)
