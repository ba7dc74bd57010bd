"""The scheduler-side role of the KV hand-off, one per engine: what the engine loop asks about
transfers, with every state owned by someone and bounded by a lease.

Decode (`--kv-role decode`):
  prepare   a lease granted to the gateway takes the destination blocks of the prompt's full blocks
            after what this engine caches (decode reserves first); the descriptor names them.
  commit    (from the receiver) the checked bytes are written into those blocks, which join the
            lease's pinned prefix and the prefix cache; the request that draws on the lease then
            computes only the last, partial block and samples as the colocated engine would.
  abort     the blocks go back to the pool, promised to the lease again (decode-only fallback);
  expiry    an unused lease ends by itself and takes its blocks along.
Prefill (`--kv-role prefill`):
  start     a request carrying a descriptor (checked against this engine's layout and weights);
  step      each step's newly filled prompt blocks are exported and queued to the sender;
  finish    when the prompt is done its sent blocks are held, the commit goes out with the first
            token, and the request's last output waits for decode's ack; the ack (or a failure,
            or the lease's end) frees the blocks and ends the request, with why when it failed.
"""
from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshserve.kv_transfer import KV_ROLES
from meshserve.kv_transfer.descriptor import KVLayout, TransferDescriptor, check_compatible
from meshserve.kv_transfer.receiver import Incoming, KVReceiver
from meshserve.kv_transfer.sender import KVSender, SendResult
from meshserve.kv_transfer.transport import make_transport
from meshserve.tokenizer import tokenizer_hash

if TYPE_CHECKING:
    from meshserve.engine.block_manager import BlockManager
    from meshserve.engine.scheduler import ScheduledSeq
    from meshserve.engine.sequence import Sequence
    from meshserve.worker.executor import Executor

logger = logging.getLogger("meshserve")

LEASE_LOOK_S = 0.5  # how often an idle engine looks at the leases of transfers in flight


@dataclass(frozen=True)
class Identity:
    model: str
    revision: str
    tokenizer: str
    parallel: dict[str, int]


@dataclass
class _Send:
    desc: TransferDescriptor
    seq: Sequence
    next_block: int  # prompt block index of the next block to export
    held: list[int]  # block ids kept out of the pool until the transfer ends
    committed: bool = False
    finished: Any = None  # (the request's state, its last delta) once the request is done


class KVConnector:
    def __init__(self, role: str, transport: str, host: str, port: int, executor: Executor,
                 block_manager: BlockManager, identity: Identity, layout: KVLayout,
                 max_staged_bytes: int = 1 << 30) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        self.role = role
        self.executor, self.bm, self.identity, self.layout = executor, block_manager, identity, layout
        self._bell_r, self._bell_w = socket.socketpair()
        self._bell_r.setblocking(False)
        self._bell_w.setblocking(False)
        self.transport = make_transport(transport)
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        self.address = ""
        if role == "decode":
            self.receiver = KVReceiver(self._ring, max_staged_bytes)
            self.address = self.transport.listen(self.receiver, host, port)
            logger.info("KV hand-off: decode role, receiving on %s (%s)", self.address, transport)
        else:
            self.sender = KVSender(self.transport, self._ring)
            logger.info("KV hand-off: prefill role, sending over %s", transport)
        self._sends: dict[str, _Send] = {}  # by request id
        self._imports: dict[str, tuple[str, str]] = {}  # transfer id -> (lease id, owner)
        self._last_poll = 0.0
        # Cumulative figures for /metrics.
        self.bytes_total = 0
        self.seconds_total = 0.0
        self.transfers_ok = 0
        self.transfers_failed = 0

    # ---- waking the engine loop ---------------------------------------------------------------
    def _ring(self) -> None:
        try:
            self._bell_w.send(b"x")
        except BlockingIOError:
            pass  # already ringing

    def watch(self, sentinels: list, interval: float | None) -> tuple[list, float | None]:
        """What the idle engine loop waits on: also a bell that rings when a transfer moved, and
        while transfers are in flight it looks at their leases every half second."""
        return [*sentinels, self._bell_r], (LEASE_LOOK_S if self.busy else interval)

    def _drain(self) -> None:
        try:
            while self._bell_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    # ---- decode --------------------------------------------------------------------------------
    def prepare(self, lease_id: str, owner: str, prompt_token_ids: list[int], request_id: str = "",
                attempt_id: str = "") -> dict[str, Any] | None:
        """The descriptor for the prompt under the owner's lease; {"num_blocks": 0} when this engine
        caches every full block already; None when the lease cannot take it or staging is full.
        ValueError: not a decode engine, or the lease is unknown."""
        if self.receiver is None:
            raise ValueError("this engine does not receive KV (start it with --kv-role decode)")
        lease = self.bm.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise LookupError(f"reservation {lease_id!r} does not exist (it ended or expired)")
        bs = self.layout.block_size
        first = len(lease.pinned)
        num = (len(prompt_token_ids) - 1) // bs - first
        if num <= 0:
            return {"transfer_id": "", "num_blocks": 0, "num_bytes": 0, "num_tokens": 0}
        blocks = self.bm.take_for_import(lease_id, owner, num)
        if blocks is None:
            return None
        _renew(lease)  # the hand-off starts now: its lease runs from here
        wall_expiry = time.time() + (lease.expires_at - time.monotonic())
        desc = TransferDescriptor(
            uuid.uuid4().hex, request_id, attempt_id, self.identity.model, self.identity.revision,
            self.identity.tokenizer, self.layout, first, num, [b.block_id for b in blocks],
            num * self.layout.block_bytes(), self.address, self.transport.name, lease_id, wall_expiry,
            dict(self.identity.parallel))
        if not self.receiver.expect(desc, list(prompt_token_ids)):
            self.bm.cancel_import(lease_id)
            return None
        self._imports[desc.transfer_id] = (lease_id, owner)
        return desc.to_dict()

    def _poll_decode(self) -> None:
        assert self.receiver is not None
        for incoming in self.receiver.take_commits():
            self._write(incoming)
        for incoming in self.receiver.pending():  # a lease that ended takes its transfer along
            if incoming.desc.lease_id not in self.bm.leases:
                self.receiver.drop(incoming.desc.transfer_id)
                self._imports.pop(incoming.desc.transfer_id, None)

    def _write(self, incoming: Incoming) -> None:
        desc = incoming.desc
        lease = self.bm.leases.get(desc.lease_id)
        verdict = incoming.verdict or ""
        if not verdict and (lease is None or [b.block_id for b in lease.importing] != desc.dst_block_ids):
            verdict = "the reservation for this transfer ended"
        if not verdict:
            try:
                assert lease is not None
                self.executor.import_kv(desc.dst_block_ids, incoming.payload())
                self.bm.commit_import(lease, incoming.token_ids)
                _renew(lease)  # the request that draws on it gets a whole lease period to come
                self.bytes_total += incoming.num_bytes
                self.transfers_ok += 1
            except Exception as exc:  # the ranks refused the write: the blocks hold nothing usable
                logger.exception("writing KV hand-off %s failed", desc.transfer_id)
                verdict = f"the decode engine could not write the blocks: {type(exc).__name__}: {exc}"
        if verdict:
            self.bm.cancel_import(desc.lease_id)
            self.transfers_failed += 1
        self._imports.pop(desc.transfer_id, None)
        self.receiver.finish(incoming, verdict)  # type: ignore[union-attr]

    # ---- prefill -------------------------------------------------------------------------------
    def start_send(self, request_id: str, seq: Sequence, params: Any) -> None:
        """Begin the hand-off of a request carrying descriptor `params`. ValueError: it is malformed,
        this is not a prefill engine, or it does not fit this engine (layout, weights, tokenizer)."""
        if self.sender is None:
            raise ValueError("this engine does not send KV (start it with --kv-role prefill)")
        desc = TransferDescriptor.from_dict(params)
        check_compatible(desc, self.layout, self.identity.revision, self.identity.tokenizer)
        if (seq.num_prompt_tokens - 1) // self.layout.block_size < desc.first_block + desc.num_blocks:
            raise ValueError(f"the descriptor names {desc.first_block + desc.num_blocks} full blocks; "
                             f"this prompt of {seq.num_prompt_tokens} tokens has fewer")
        if desc.lease_expires_at <= time.time():
            raise ValueError("the descriptor's reservation has already ended")
        self._sends[request_id] = _Send(desc, seq, desc.first_block, [])

    def after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Export the prompt blocks this step filled (before outputs may free them)."""
        bs = self.layout.block_size
        for item in scheduled:
            send = self._sends.get(item.seq.request_id)
            if send is None or send.seq is not item.seq or send.committed:
                continue
            desc = send.desc
            end = min(desc.first_block + desc.num_blocks, (item.start + item.num_tokens) // bs)
            if end > send.next_block:
                ids = item.seq.block_table[send.next_block:end]
                self.sender.chunk(desc, send.next_block - desc.first_block,  # type: ignore[union-attr]
                                  self.executor.export_kv(ids))
                self.bm.hold(ids)
                send.held += ids
                send.next_block = end

    def hold_finished(self, request_id: str, state: Any, delta: Any) -> bool:
        """A finished request whose hand-off is under way: its last output waits for the ack."""
        send = self._sends.get(request_id)
        if send is None:
            return False
        seq = send.seq
        if send.next_block < send.desc.first_block + send.desc.num_blocks or seq.num_output_tokens < 1:
            return False  # it ended before its prompt was done (an abort): request_ended cleans up
        send.committed = True
        send.finished = (state, delta)
        self.sender.commit(send.desc, seq.token_ids[seq.num_prompt_tokens],  # type: ignore[union-attr]
                           dict(self.identity.parallel))
        return True

    def request_ended(self, request_id: str) -> None:
        """A request with a hand-off ended early (aborted, failed): stop it on both legs."""
        send = self._sends.pop(request_id, None)
        if send is not None:
            self.sender.abort(send.desc)  # type: ignore[union-attr]
            self.bm.unhold(send.held)

    def _poll_prefill(self, done: Callable[[Any, Any, SendResult], None]) -> None:
        assert self.sender is not None
        results = {r.transfer_id: r for r in self.sender.take_results()}
        now = time.time()
        for request_id, send in list(self._sends.items()):
            result = results.get(send.desc.transfer_id)
            if result is None and send.desc.lease_expires_at <= now:  # a slow or dead peer: one lease, no more
                self.sender.abort(send.desc)
                result = SendResult(send.desc.transfer_id, "the decode engine did not acknowledge before the "
                                    "reservation ended", 0, 0.0)
            if result is None:
                continue
            if result.error is None:
                self.bytes_total += result.num_bytes
                self.seconds_total += result.seconds
                self.transfers_ok += 1
            else:
                self.transfers_failed += 1
            del self._sends[request_id]
            self.bm.unhold(send.held)
            if send.finished is not None:
                state, delta = send.finished
                done(state, delta, result)
            else:  # failed while the prompt still runs: the engine ends the request with why
                done(None, request_id, result)

    # ---- the loop --------------------------------------------------------------------------------
    def has_news(self) -> bool:
        """A transfer moved, or leases in flight are due a look: the engine loop should step."""
        if (self.receiver is not None and self.receiver.has_commits()) or \
                (self.sender is not None and self.sender.has_results()):
            return True
        return self.busy and time.monotonic() - self._last_poll >= LEASE_LOOK_S

    def poll(self, done: Callable[[Any, Any, SendResult], None]) -> None:
        """Move every transfer that has news (the engine loop calls it once per iteration)."""
        self._last_poll = time.monotonic()
        self._drain()
        if self.receiver is not None:
            self._poll_decode()
        else:
            self._poll_prefill(done)

    def abort(self, transfer_id: str) -> bool:
        """Abort a hand-off on this leg (idempotent): decode returns its blocks to the lease; prefill
        stops sending (the engine then ends the request)."""
        if self.receiver is not None:
            entry = self._imports.pop(transfer_id, None)
            incoming = self.receiver.drop(transfer_id)
            if entry is not None:
                self.bm.cancel_import(entry[0])
            return entry is not None or incoming is not None
        return any(s.desc.transfer_id == transfer_id for s in self._sends.values())

    def request_for(self, transfer_id: str) -> str | None:
        return next((rid for rid, s in self._sends.items() if s.desc.transfer_id == transfer_id), None)

    @property
    def waiting_requests(self) -> int:
        """Finished requests whose output waits for an ack (no step can move them)."""
        return sum(1 for s in self._sends.values() if s.finished is not None)

    @property
    def busy(self) -> bool:
        """Transfers in flight: the idle loop must keep an eye on their leases."""
        return bool(self._sends) or bool(self.receiver and self.receiver.pending())

    def stats(self) -> dict[str, float]:
        return {"kv_transfer_bytes": self.bytes_total, "kv_transfer_seconds": self.seconds_total,
                "kv_transfers_ok": self.transfers_ok, "kv_transfers_failed": self.transfers_failed}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.transport.close()
        self._bell_r.close()
        self._bell_w.close()


def make_connector(config: Any, executor: Executor, block_manager: BlockManager, source: Any,
                   tokenizer: Any) -> KVConnector | None:
    """The engine's connector for its --kv-role (None for "both": the colocated engine)."""
    if config.kv_role == "both":
        return None
    lay = executor.kv_layout()
    layout = KVLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size,
                      str(lay.kv_dtype).removeprefix("torch."))
    identity = Identity(source.model_id, str(source.revision), tokenizer_hash(tokenizer),
                        {"tp": config.tensor_parallel_size, "pp": config.pipeline_parallel_size})
    return KVConnector(config.kv_role, config.kv_transport, config.kv_host, config.kv_port, executor,
                       block_manager, identity, layout)


def _renew(lease: Any) -> None:
    lease.expires_at = max(lease.expires_at, time.monotonic() + lease.ttl_s)
