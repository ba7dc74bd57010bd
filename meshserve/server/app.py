"""The FastAPI application: routes, the request-id / API-key / body-size middleware, error handlers."""
from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Callable

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

import meshserve
from meshserve.api.errors import APIError, bad_request, error_body
from meshserve.api.load import LOAD_HEADER
from meshserve.api.protocol import DetokenizeRequest, ReservationRequest, TokenizeRequest
from meshserve.api.sse import ClientDisconnected, JSONBytesResponse
from meshserve.distributed.expert_load import summarize
from meshserve.engine.messages import ReserveRequest
from meshserve.server.engine_client import EngineCallError, EngineDeadError
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
    """Pure ASGI (streams pass through untouched): X-Request-Id (and, given `load_report`, the
    server's load figures) on every response, the API key, and the declared body size, all checked
    before a route runs."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 load_report: Callable[[], str] | None = None) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.load_report = load_report

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
                if self.load_report is not None:
                    message["headers"].append((LOAD_HEADER.lower().encode(), self.load_report().encode("ascii")))
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
                       max_body_bytes=ctx.config.max_body_bytes, load_report=ctx.load_report)

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
        return JSONBytesResponse({"version": meshserve.__version__, "model": ctx.model_info,
                                  "served_model_name": ctx.model_name, "engine_config": engine_config,
                                  "server_config": ctx.config.public_dict(), **ctx.identity,
                                  "reservations": True})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = parse(TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages", param="prompt")
        if req.messages is not None:
            tokens = await ctx.render_chat(req.messages, req.add_generation_prompt)
        else:
            tokens = await ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
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
            code = "reservations_unsupported" if "does not support" in str(exc) else "invalid_parameter"
            raise APIError(501 if code == "reservations_unsupported" else 400, str(exc), code=code) from None
        if lease is None:
            raise APIError(409, "not enough unreserved KV blocks for this request now",
                           code="insufficient_kv_capacity", headers={"Retry-After": "1"})
        lease["expires_at"] = round(time.time() + lease["expires_in_s"], 3)
        return JSONBytesResponse(lease, status_code=201)

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
            "num_blocks": sum(e["num_blocks"] for e in engines),
            "reserved_blocks": sum(e["reserved_blocks"] for e in engines),
            "leases": [lease for e in engines for lease in e.pop("leases")], "engines": engines})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = parse(DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
        ctx.check_model(req.model)
        ids = ctx.check_prompt_ids(req.tokens, param="tokens")
        return JSONBytesResponse({"prompt": ctx.tokenizer.decode(ids)})

    return app
