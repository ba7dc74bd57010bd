"""POST/DELETE /v1/kv/transfers: the decode replica's side of a KV hand-off (the gateway's calls).

POST reserves the destination blocks of a prompt's K/V under a lease the caller holds here (decode
reserves first) and answers with the descriptor the prefill replica sends by; DELETE aborts a
hand-off on whichever leg this replica is (idempotent). The bytes themselves travel between the
engines (meshserve/kv_transfer/), never through here.
"""
from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.errors import APIError
from meshserve.api.json_body import parse, read_json
from meshserve.api.protocol import KVTransferRequest
from meshserve.api.sse import JSONBytesResponse
from meshserve.engine.errors import EngineCallError, EngineDeadError
from meshserve.engine.messages import KVPrepare
from meshserve.server.call_errors import lease_call_error
from meshserve.server.serving import ServingContext


def add_kv_transfer_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/kv/transfers")
    async def prepare(request: Request) -> Response:
        req = parse(KVTransferRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_prompt_ids(req.prompt_token_ids, param="prompt_token_ids")
        try:
            desc = await ctx.client.calls.kv_prepare(KVPrepare(
                req.lease_id, req.prompt_token_ids, request.state.key_owner, req.request_id, req.attempt_id))
        except (EngineDeadError, EngineCallError) as exc:
            raise lease_call_error(exc, "kv_role_unsupported") from None
        if desc is None:
            raise APIError(409, "no room for this hand-off now (its reservation or the staging bound)",
                           code="insufficient_kv_capacity", headers={"Retry-After": "1"})
        return JSONBytesResponse({"descriptor": desc}, status_code=201)

    @app.delete("/v1/kv/transfers/{transfer_id}")
    async def abort(transfer_id: str) -> Response:
        try:
            aborted = await ctx.client.calls.kv_abort(transfer_id)
        except (EngineDeadError, EngineCallError):  # gone with its engine, or never here
            aborted = False
        return JSONBytesResponse({"transfer_id": transfer_id, "aborted": aborted})
