"""POST/DELETE /v1/reservations on the replicas: the leases the gateway asks their engines for.

A grant (201) or a refusal for want of room (409, or 429: this gateway holds as many leases there as
it may) is the engine's answer. Any other 4xx refuses the request itself, the client's mistake: it
goes back to the client and never counts against the replica. A 5xx, a malformed grant, or no
answer within `reservation_timeout_s` is the replica's failure.

Leases are all-or-nothing across replicas (`reserve_all`): a placement that needs a prefill and a
decode replica at once takes both leases or neither, and a lease never used ends by itself after
`lease_ttl_s` on the engine, so a gateway that dies mid-way strands nothing.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import aiohttp

from meshserve.api.errors import APIError
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.replicas import LeaseRecord, Replica

if TYPE_CHECKING:
    from meshserve.gateway.admission import AdmissionRequest


class ReservationFailed(Exception):
    """The replica did not answer the reservation as a replica must (a 5xx, a malformed grant)."""


def refused_by_replica(status: int, answer: object, headers: Mapping[str, str]) -> APIError:
    """A replica's 4xx, passed to the client as the replica put it."""
    err = answer.get("error") if isinstance(answer, dict) else None
    err = err if isinstance(err, dict) else {}
    retry = {"Retry-After": headers["Retry-After"]} if "Retry-After" in headers else {}
    return APIError(status, str(err.get("message") or f"the replica refused the request ({status})"),
                    param=err.get("param"), code=err.get("code"), headers=retry)


class Reserver:
    def __init__(self, session: aiohttp.ClientSession, config: GatewayConfig) -> None:
        self.session = session
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=config.reservation_timeout_s,
                                              sock_connect=config.connect_timeout_s)

    async def reserve(self, replica: Replica, req: AdmissionRequest, token_ids: Sequence[int],
                      max_tokens: int) -> LeaseRecord | None:
        """A lease, or None when the replica's engine refused for want of room. APIError: the
        replica refused the request itself. aiohttp.ClientError / TimeoutError / ReservationFailed:
        the replica did not answer as it should."""
        body = {"prompt_token_ids": list(token_ids), "max_tokens": max_tokens, "n": req.n,
                "ttl_s": self.config.lease_ttl_s, "request_id": req.request_id, "attempt_id": req.attempt_id,
                "cache_salt": req.cache_salt}
        async with self.session.post(replica.url + "/v1/reservations", json=body, timeout=self._timeout) as resp:
            if resp.status in (409, 429):
                return None
            try:
                answer = await resp.json(content_type=None)
            except ValueError:
                answer = None
            if 400 <= resp.status < 500:
                raise refused_by_replica(resp.status, answer, resp.headers)
            if resp.status != 201:
                raise ReservationFailed(f"the reservation answered {resp.status}")
        try:
            if not isinstance(answer, dict):
                raise TypeError(type(answer).__name__)
            record = LeaseRecord(str(answer["lease_id"]), int(answer["blocks"]) + int(answer.get("pinned_blocks", 0)),
                                 req.request_id)
        except (TypeError, KeyError, ValueError):
            raise ReservationFailed("the replica granted a reservation it did not describe") from None
        replica.leases[record.lease_id] = record
        return record

    async def reserve_all(self, wanted: list[tuple[Replica, AdmissionRequest, list[int], int]],
                          ) -> list[LeaseRecord] | None:
        """Leases on several replicas, all or none: a refusal releases those already granted."""
        granted: list[tuple[Replica, LeaseRecord]] = []
        try:
            for replica, req, ids, max_tokens in wanted:
                lease = await self.reserve(replica, req, ids, max_tokens)
                if lease is None:
                    break
                granted.append((replica, lease))
            else:
                return [lease for _, lease in granted]
        except BaseException:
            await asyncio.gather(*(self.release(r, lease) for r, lease in granted))
            raise
        await asyncio.gather(*(self.release(r, lease) for r, lease in granted))
        return None

    async def release(self, replica: Replica, lease: LeaseRecord) -> None:
        """End a lease the request did not use up. If the replica cannot confirm, the record stays
        (orphaned, still counted) until reconciliation with the replica's ledger."""
        try:
            async with self.session.delete(f"{replica.url}/v1/reservations/{lease.lease_id}",
                                           timeout=self._timeout) as resp:
                if resp.status in (200, 404):  # 404: it had ended already
                    replica.leases.pop(lease.lease_id, None)
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        lease.orphaned = True

    @staticmethod
    def ended(replica: Replica, lease: LeaseRecord | None) -> None:
        """The request that drew on it finished: the engine has ended the lease itself."""
        if lease is not None:
            replica.leases.pop(lease.lease_id, None)
