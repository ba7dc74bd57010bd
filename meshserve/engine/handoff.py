"""The engine's side of a KV hand-off (meshserve/kv_transfer/connector.py does the transfers): the
calls a decode engine answers, and how a prefill request whose hand-off ended leaves the engine."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from meshserve.engine.block_manager import ReservationError
from meshserve.engine.messages import ErrorCode, KVPrepare, RequestDelta
from meshserve.engine.protocol import UnsupportedCall
from meshserve.kv_transfer.sender import SendResult

if TYPE_CHECKING:
    from meshserve.engine.output import EngineRequest
    from meshserve.engine.reservations import LeaseDesk
    from meshserve.kv_transfer.connector import KVConnector


class HandoffCalls:
    """Mixed into LLMEngine, whose parts it uses:"""
    if TYPE_CHECKING:
        kv: KVConnector | None
        requests: dict[str, EngineRequest]
        desk: LeaseDesk
        _ended_between_steps: list[RequestDelta]

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

