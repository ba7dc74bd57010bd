"""The engine's answers about leases: grant, release, the ledger, and expiry, per owner.

The blocks themselves are the block manager's (block_manager.py: what a lease holds back and pins);
this is who may see what. A lease belongs to the owner that asked for it (a digest of the caller's
API key, "" on an open server): another owner can neither use it, nor see it in the ledger, nor end
it, and an unknown lease and another owner's answer alike. Each owner may hold a bounded number.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from meshserve.engine.block_manager import BlockManager, Lease
from meshserve.engine.messages import LeaseInfo, LeaseLedger, LeaseRef, ReserveRequest

logger = logging.getLogger("meshserve")


class LeaseDesk:
    def __init__(self, block_manager: BlockManager, max_model_len: int, is_running: Callable[[str], bool]) -> None:
        self.bm = block_manager
        self.max_model_len = max_model_len
        self._is_running = is_running  # whether an engine request of that id is still here

    def reserve(self, req: ReserveRequest) -> LeaseInfo | None:
        """Grant a lease for `req` against the blocks not held back already, or None.
        ValueError: a prompt that cannot be served; block_manager.LeaseLimitError: the owner's bound."""
        self.reconcile()
        if not req.prompt_token_ids or len(req.prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids must hold 1 to {self.max_model_len - 1} tokens")
        max_new = min(req.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        lease = self.bm.reserve(uuid.uuid4().hex, req.prompt_token_ids, max_new, req.n,
                                time.monotonic() + req.ttl_s, req.request_id, req.attempt_id, req.owner,
                                req.cache_salt, req.max_owner_leases)
        if lease is None:
            return None
        lease.ttl_s = req.ttl_s
        return self._info(lease, time.monotonic())

    def holder(self, ref: LeaseRef) -> tuple[bool, str | None]:
        """(whether the owner has this lease, the running request drawing on it if any)."""
        lease = self.bm.leases.get(ref.lease_id)
        if lease is None or lease.owner != ref.owner:
            return False, None
        bound = lease.bound_to
        return True, bound if bound is not None and self._is_running(bound) else None

    def release(self, lease_id: str) -> None:
        self.bm.release(lease_id)

    def reconcile(self) -> None:
        """Expired leases: one whose request is still running here keeps its blocks until that request
        ends; any other (never used, or its request is gone) returns its blocks now."""
        for lease in self.bm.expired_leases(time.monotonic()):
            if lease.bound_to is None or not self._is_running(lease.bound_to):
                logger.info("reservation %s of request %s expired unused; its %d blocks return",
                            lease.lease_id, lease.request_id, lease.blocks)
                self.bm.release(lease.lease_id)

    def ledger(self, owner: str) -> LeaseLedger:
        """The block totals, and the leases of `owner` (GET /v1/reservations)."""
        self.reconcile()
        bm, now = self.bm, time.monotonic()
        return LeaseLedger(bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.reserved_blocks, bm.held_back,
                           bm.peak_reserved,
                           [self._info(lease, now) for lease in bm.leases.values() if lease.owner == owner])

    @staticmethod
    def _info(lease: Lease, now: float) -> LeaseInfo:
        return LeaseInfo(lease.lease_id, lease.request_id, lease.attempt_id, lease.blocks, len(lease.pinned),
                         lease.taken, lease.bound_to is not None, round(lease.expires_at - now, 3))
