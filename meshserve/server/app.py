"""The FastAPI application: routes, the request-id / API-key / body-size middleware, error handlers."""
from __future__ import annotations

import hmac
import logging
import uuid

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

import meshserve
from meshserve.api.errors import APIError, bad_request, error_body
from meshserve.api.protocol import DetokenizeRequest, TokenizeRequest
from meshserve.api.sse import ClientDisconnected, JSONBytesResponse
from meshserve.distributed.expert_load import summarize
from meshserve.server.metrics import CONTENT_TYPE, ServerMetrics
from meshserve.server.serving import ServingContext, parse, read_json
from meshserve.server.serving_chat import create_chat_completion
from meshserve.server.serving_completion import create_completion

logger = logging.getLogger(__name__)

# Reachable without the API key: liveness probes and Prometheus scrapers.
_OPEN_PATHS = frozenset({"/health", "/metrics"})
_MAX_REQUEST_ID = 128
# nginx's non-standard "client closed request": only logs ever see it.
_CLIENT_CLOSED = 499


def error_response(err: APIError) -> Response:
    return JSONBytesResponse(err.body(), status_code=err.status, headers=err.headers)


class RequestContextMiddleware:
    """Pure ASGI (streams pass through untouched): X-Request-Id on every response, the API key,
    and the declared body size, all checked before a route runs."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")
        if not request_id or len(request_id) > _MAX_REQUEST_ID or not request_id.isprintable():
            request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()),
                                      (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        error = self._precheck(scope, headers)
        if error is not None:
            await error_response(error)(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            err = APIError(500, "internal server error", code="internal_error")
            await error_response(err)(scope, receive, send_with_id)

    def _precheck(self, scope, headers: Headers) -> APIError | None:
        if self.expected_auth is not None and scope["path"] not in _OPEN_PATHS:
            given = headers.get("authorization", "").encode("latin-1")
            if not hmac.compare_digest(given, self.expected_auth):
                return APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return bad_request("Content-Length is not a number", code="invalid_header")
            if int(length) > self.max_body_bytes:
                return APIError(413, f"request body is larger than {self.max_body_bytes} bytes",
                                code="request_too_large")
        return None


def build_app(ctx: ServingContext, metrics: ServerMetrics, engine_config: dict) -> FastAPI:
    app = FastAPI(title="meshserve", version=meshserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RequestContextMiddleware, api_key=ctx.config.api_key,
                       max_body_bytes=ctx.config.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

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
                "revision": ctx.model_info.get("revision")}
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
        return JSONBytesResponse({"version": meshserve.__version__, "model": ctx.model_info,
                                  "served_model_name": ctx.model_name, "engine_config": engine_config,
                                  "server_config": ctx.config.public_dict()})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        tokens = await ctx.encode(req.prompt)
        return JSONBytesResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        ids = ctx.check_prompt_ids(req.tokens, param="tokens")
        return JSONBytesResponse({"prompt": ctx.tokenizer.decode(ids)})

    return app
