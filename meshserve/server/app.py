"""The FastAPI application: routes, the request-id / API-key / body-size middleware, error handlers."""
from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

import meshserve
from meshserve.api.errors import bad_request, error_body
from meshserve.api.json_body import parse, read_json
from meshserve.api.middleware import RequestContextMiddleware, install_error_handlers
from meshserve.api.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
)
from meshserve.api.sse import JSONBytesResponse
from meshserve.distributed.expert_load import summarize
from meshserve.server.kv_transfers import add_kv_transfer_routes
from meshserve.server.metrics import CONTENT_TYPE, ServerMetrics
from meshserve.server.reservations import add_reservation_routes
from meshserve.server.serving import ServingContext
from meshserve.server.serving_chat import create_chat_completion
from meshserve.server.serving_completion import create_completion
from meshserve.server.tools import rendered_tools

logger = logging.getLogger(__name__)


def build_app(ctx: ServingContext, metrics: ServerMetrics, engine_config: dict) -> FastAPI:
    app = FastAPI(title="meshserve", version=meshserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RequestContextMiddleware, api_key=ctx.config.api_key,
                       max_body_bytes=ctx.config.max_body_bytes, load_report=ctx.load_report,
                       metrics_api_key=ctx.config.metrics_api_key)

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
        """200 while some engine's loop answers ("ok", or "degraded" while one restarts or does not
        answer); 503 when none does: the answer goes through the engine process, so an engine that
        is wedged or stopped behind a live front end shows here."""
        responsive = await ctx.client.calls.responsive(ctx.config.health_timeout)
        state = ctx.client.health(responsive)
        if not any(responsive.values()):
            body = error_body(503, "no engine is answering", code="engine_unavailable")
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
                                  "reservations": True, "kv_role": engine_config.get("kv_role", "both")})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        if req.messages is not None and req.prompt is None:
            tokens = await ctx.render_chat(req.messages, req.add_generation_prompt,
                                           rendered_tools(req.tools, req.tool_choice))
        elif req.prompt is not None and req.messages is None:
            tokens = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send either prompt or messages", param="prompt")
        return JSONBytesResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})

    add_reservation_routes(app, ctx)
    add_kv_transfer_routes(app, ctx)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        ids = ctx.check_prompt_ids(req.tokens, param="tokens")
        return JSONBytesResponse({"prompt": ctx.tokenizer.decode(ids)})

    return app
