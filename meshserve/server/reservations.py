"""POST/GET/DELETE /v1/reservations: KV leases the engine grants or refuses, atomically for all its
ranks. A lease belongs to the API key that asked for it: only that key can use it (X-Reservation-Id),
see it in the ledger or release it; another key's lease answers as if it did not exist. A lease
lives at most --max-lease-ttl unused, and one key may hold at most --max-leases-per-key per engine."""
from __future__ import annotations

import time
from dataclasses import asdict

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.errors import APIError, bad_request
from meshserve.api.json_body import parse, read_json
from meshserve.api.protocol import ReservationRequest
from meshserve.api.sse import JSONBytesResponse
from meshserve.engine.errors import EngineCallError, EngineDeadError
from meshserve.engine.messages import ReserveRequest
from meshserve.server.call_errors import lease_call_error
from meshserve.server.serving import ServingContext


def add_reservation_routes(app: FastAPI, ctx: ServingContext) -> None:
    config = ctx.config

    @app.post("/v1/reservations")
    async def reserve(request: Request) -> Response:
        req = parse(ReservationRequest, await read_json(request, config.max_body_bytes))
        ctx.check_prompt_ids(req.prompt_token_ids, param="prompt_token_ids")
        if req.ttl_s > config.max_lease_ttl:
            raise bad_request(f"ttl_s must be at most {config.max_lease_ttl:g} seconds (--max-lease-ttl), "
                              f"got {req.ttl_s:g}", param="ttl_s")
        try:
            lease = await ctx.client.calls.reserve(ReserveRequest(
                req.prompt_token_ids, req.max_tokens, req.n, req.ttl_s, req.request_id, req.attempt_id,
                req.cache_salt or "", request.state.key_owner, config.max_leases_per_key))
        except (EngineDeadError, EngineCallError) as exc:
            raise lease_call_error(exc, "reservations_unsupported") from None
        if lease is None:
            raise APIError(409, "not enough unreserved KV blocks for this request now",
                           code="insufficient_kv_capacity", headers={"Retry-After": "1"})
        body = lease.to_dict()
        body["expires_at"] = round(time.time() + lease.expires_in_s, 3)
        return JSONBytesResponse(body, status_code=201)

    @app.delete("/v1/reservations/{lease_id}")
    async def release(request: Request, lease_id: str) -> Response:
        try:
            released = await ctx.client.calls.release(lease_id, request.state.key_owner)
        except (EngineDeadError, EngineCallError):  # its leases died with it, or it never was one
            released = False
        if not released:
            raise APIError(404, f"reservation {lease_id!r} does not exist (it ended or expired)",
                           code="reservation_not_found")
        return JSONBytesResponse({"lease_id": lease_id, "released": True})

    @app.get("/v1/reservations")
    async def reservations(request: Request) -> Response:
        """The engines' own ledgers: the caller's live leases, and every engine's block totals."""
        try:
            engines = await ctx.client.calls.ledgers(request.state.key_owner)
        except EngineCallError as exc:
            raise APIError(501, str(exc), code="reservations_unsupported") from None
        return JSONBytesResponse({
            "num_blocks": sum(ledger.num_blocks for _, ledger in engines),
            "reserved_blocks": sum(ledger.reserved_blocks for _, ledger in engines),
            "leases": [lease.to_dict() for _, ledger in engines for lease in ledger.leases],
            "engines": [{"engine": rank, **{k: v for k, v in asdict(ledger).items() if k != "leases"}}
                        for rank, ledger in engines]})
