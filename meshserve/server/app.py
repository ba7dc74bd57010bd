"""The FastAPI application: routes, the request-id / API-key / body-size middleware, error handlers."""
from __future__ import annotations

import logging
import time
from dataclasses import asdict

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

import meshserve
from meshserve.api.errors import APIError, bad_request, error_body
from meshserve.api.json_body import parse, read_json
from meshserve.api.middleware import RequestContextMiddleware, install_error_handlers
from meshserve.api.protocol import (
    DetokenizeRequest,
    ReservationRequest,
    TokenizeRequest,
)
from meshserve.api.sse import JSONBytesResponse
from meshserve.distributed.expert_load import summarize
from meshserve.engine.client import EngineCallError, EngineDeadError
from meshserve.engine.messages import ReserveRequest
from meshserve.server.metrics import CONTENT_TYPE, ServerMetrics
from meshserve.server.serving import ServingContext
from meshserve.server.serving_chat import create_chat_completion
from meshserve.server.serving_completion import create_completion

logger = logging.getLogger(__name__)


def build_app(ctx: ServingContext, metrics: ServerMetrics, engine_config: dict) -> FastAPI:
    app = FastAPI(title="meshserve", version=meshserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RequestContextMiddleware, api_key=ctx.config.api_key,
                       max_body_bytes=ctx.config.max_body_bytes, load_report=ctx.load_report)

    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "meshserve",
                "root": str(engine_config.get("model") or ctx.model_name), "max_model_len": ctx.max_model_len,
                **ctx.identity}
        return JSONBytesResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        """200 while some engine takes work ("ok", or "degraded" while one restarts); 503 when none."""
        state = ctx.client.health()
        if not ctx.client.healthy:
            body = error_body(503, "no engine is running", code="engine_unavailable")
            return JSONBytesResponse({**body, **state}, status_code=503, headers={"Retry-After": "5"})
        return JSONBytesResponse(state)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/moe/expert_load")
    async def expert_load() -> Response:
        # The whole layer x expert matrix with per-rank loads and max-to-mean ratios.
        return JSONBytesResponse(summarize(ctx.client.expert_load()))

    @app.get("/server_info")
    async def server_info() -> Response:
        return JSONBytesResponse({"version": meshserve.__version__, "model": ctx.model_info.to_dict(),
                                  "served_model_name": ctx.model_name, "engine_config": engine_config,
                                  "server_config": ctx.config.public_dict(), **ctx.identity,
                                  "reservations": True})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        if req.messages is not None and req.prompt is None:
            tokens = await ctx.render_chat(req.messages, req.add_generation_prompt)
        elif req.prompt is not None and req.messages is None:
            tokens = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send either prompt or messages", param="prompt")
        return JSONBytesResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})

    # ---- KV reservations: the engine grants or refuses, atomically for all its ranks ---------------
    @app.post("/v1/reservations")
    async def reserve(request: Request) -> Response:
        req = parse(ReservationRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_prompt_ids(req.prompt_token_ids, param="prompt_token_ids")
        try:
            lease = await ctx.client.reserve(ReserveRequest(req.prompt_token_ids, req.max_tokens, req.n, req.ttl_s,
                                                            req.request_id, req.attempt_id))
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"}) from None
        except EngineCallError as exc:
            if exc.unsupported:
                raise APIError(501, str(exc), code="reservations_unsupported") from None
            raise APIError(400, str(exc), code="invalid_parameter") from None
        if lease is None:
            raise APIError(409, "not enough unreserved KV blocks for this request now",
                           code="insufficient_kv_capacity", headers={"Retry-After": "1"})
        body = lease.to_dict()
        body["expires_at"] = round(time.time() + lease.expires_in_s, 3)
        return JSONBytesResponse(body, status_code=201)

    @app.delete("/v1/reservations/{lease_id}")
    async def release(lease_id: str) -> Response:
        try:
            released = await ctx.client.release(lease_id)
        except EngineDeadError:
            released = False  # its leases died with it
        except EngineCallError:
            released = False
        if not released:
            raise APIError(404, f"reservation {lease_id!r} does not exist (it ended or expired)",
                           code="reservation_not_found")
        return JSONBytesResponse({"lease_id": lease_id, "released": True})

    @app.get("/v1/reservations")
    async def reservations() -> Response:
        """The engines' own ledgers: every live lease, and the totals per engine."""
        try:
            engines = await ctx.client.leases()
        except EngineCallError as exc:
            raise APIError(501, str(exc), code="reservations_unsupported") from None
        return JSONBytesResponse({
            "num_blocks": sum(ledger.num_blocks for _, ledger in engines),
            "reserved_blocks": sum(ledger.reserved_blocks for _, ledger in engines),
            "leases": [lease.to_dict() for _, ledger in engines for lease in ledger.leases],
            "engines": [{"engine": rank, **{k: v for k, v in asdict(ledger).items() if k != "leases"}}
                        for rank, ledger in engines]})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        ids = ctx.check_prompt_ids(req.tokens, param="tokens")
        return JSONBytesResponse({"prompt": ctx.tokenizer.decode(ids)})

    return app
