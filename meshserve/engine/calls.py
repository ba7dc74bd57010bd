"""The questions the front end asks its engines, answered between steps: reservations (each engine
keeps the ledger of its own KV) and the liveness ping that /health goes through.

A lease id names its engine ("<rank>.<the engine's id>"), so release and use go to the engine that
granted it; every lease call carries its owner (a digest of the caller's API key), and an engine
shows and ends only that owner's leases.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from meshserve.engine.errors import EngineCallError, EngineDeadError
from meshserve.engine.messages import CallMethod, KVPrepare, LeaseInfo, LeaseLedger, LeaseRef, ReserveRequest

if TYPE_CHECKING:
    from meshserve.engine.client import EngineClient


def lease_engine(lease_id: str, num_engines: int) -> tuple[int, str]:
    """(the rank of the engine that granted the lease, its own id). EngineCallError: not a lease id."""
    rank, sep, rest = lease_id.partition(".")
    if not sep or not rank.isdigit() or int(rank) >= num_engines or not rest:
        raise EngineCallError(f"reservation {lease_id!r} does not exist")
    return int(rank), rest


class EngineCalls:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def reserve(self, req: ReserveRequest) -> LeaseInfo | None:
        """A lease from the first engine that grants it, those with the most unpromised free blocks
        asked first; None when none can."""
        client = self.client
        live = sorted(client.supervisor.alive_ranks(), key=lambda rank: -client.unpromised_blocks(rank))
        if not live:
            raise EngineDeadError("no engine is running")
        for rank in live:
            try:
                lease: LeaseInfo | None = await client.call(rank, CallMethod.RESERVE, req)
            except EngineDeadError:
                continue
            if lease is not None:
                lease.lease_id = f"{rank}.{lease.lease_id}"
                return lease
        return None

    async def release(self, lease_id: str, owner: str) -> bool:
        rank, own_id = lease_engine(lease_id, self.client.supervisor.size)
        return bool(await self.client.call(rank, CallMethod.RELEASE, LeaseRef(own_id, owner)))

    async def kv_prepare(self, req: KVPrepare) -> dict[str, Any] | None:
        """The hand-off descriptor of the engine that granted `req.lease_id` (None: no room now)."""
        rank, own_id = lease_engine(req.lease_id, self.client.supervisor.size)
        req.lease_id = own_id
        desc: dict[str, Any] | None = await self.client.call(rank, CallMethod.KV_PREPARE, req)
        if desc is not None and desc.get("lease_id"):
            desc["lease_id"] = f"{rank}.{desc['lease_id']}"
        return desc

    async def kv_abort(self, transfer_id: str) -> bool:
        """Abort a hand-off on whichever engine here has it (transfer ids are unique)."""
        found = False
        for rank in self.client.supervisor.alive_ranks():
            try:
                found = bool(await self.client.call(rank, CallMethod.KV_ABORT, transfer_id)) or found
            except EngineDeadError:
                continue
        return found

    async def ledgers(self, owner: str) -> list[tuple[int, LeaseLedger]]:
        """Each live engine's ledger of `owner`'s leases, the lease ids named as reserve() names them."""
        out = []
        for rank in self.client.supervisor.alive_ranks():
            try:
                ledger: LeaseLedger = await self.client.call(rank, CallMethod.LEASES, owner)
            except EngineDeadError:
                continue
            for lease in ledger.leases:
                lease.lease_id = f"{rank}.{lease.lease_id}"
            out.append((rank, ledger))
        return out

    async def responsive(self, timeout_s: float) -> dict[int, bool]:
        """Whether each live engine's loop answers within `timeout_s` (a wedged or stopped engine
        process does not, however alive its process looks); a busy engine whose steps keep
        finishing counts without waiting for its current step to end."""
        ranks = self.client.supervisor.alive_ranks()

        async def ping(rank: int) -> bool:
            if self.client.stepping(rank, timeout_s):  # mid-step, steps finishing: alive, and no wait
                return True
            try:
                return bool(await asyncio.wait_for(self.client.call(rank, CallMethod.PING), timeout_s))
            except (TimeoutError, EngineDeadError):
                return False

        return dict(zip(ranks, await asyncio.gather(*(ping(r) for r in ranks))))
