"""The request-context middleware both front ends (replica server and gateway) put in front of their
routes, and the one way an APIError becomes a response."""
from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshserve.api.errors import APIError, bad_request
from meshserve.api.load import LOAD_HEADER
from meshserve.api.sse import JSONBytesResponse

logger = logging.getLogger(__name__)

# An idle keep-alive connection is closed by the server after SERVER_KEEP_ALIVE_S and dropped by
# the pools of our own clients (the gateway's, the benchmark's) after UPSTREAM_KEEP_ALIVE_S. A
# client that reuses a connection in the instant the server closes it loses that request ("server
# disconnected"), so a server must keep connections longer than its clients' pools do: aiohttp's
# pool keeps them 15 s, httpx's 5 s, and uvicorn's default (5 s, also vLLM's and SGLang's) is what
# the servers our clients talk to may use.
SERVER_KEEP_ALIVE_S = 75
UPSTREAM_KEEP_ALIVE_S = 4

# Reachable without the API key: liveness probes. /metrics takes the API key or the metrics key.
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
_MAX_REQUEST_ID = 128
# nginx's non-standard "client closed request": only logs ever see it.
CLIENT_CLOSED = 499


def error_response(err: APIError) -> Response:
    return JSONBytesResponse(err.body(), status_code=err.status, headers=err.headers)


class RequestContextMiddleware:
    """Pure ASGI (streams pass through untouched): X-Request-Id (and, given `load_report`, the
    server's load figures) on every response, the API key, and the declared body size, all checked
    before a route runs."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 load_report: Callable[[], str] | None = None, metrics_api_key: str | None = None) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.metrics_auth = f"Bearer {metrics_api_key}".encode() if metrics_api_key else None
        self.max_body_bytes = max_body_bytes
        self.load_report = load_report

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id", "")
        if not request_id or len(request_id) > _MAX_REQUEST_ID or not request_id.isprintable():
            request_id = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["key_owner"] = key_owner(headers.get("authorization", ""))
        started = False

        async def send_with_id(message: Message) -> None:
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

    def _precheck(self, scope: Scope, headers: Headers) -> APIError | None:
        path = scope["path"]
        accepted = [self.expected_auth, self.metrics_auth if path == METRICS_PATH else None]
        keys = [k for k in accepted if k is not None]
        if keys and path not in OPEN_PATHS:
            given = headers.get("authorization", "").encode("latin-1")
            if not any(hmac.compare_digest(given, k) for k in keys):
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


def key_owner(authorization: str) -> str:
    """Who a request is, for what it owns (leases): a digest of the key it presents, "" without one.
    The key itself is never kept."""
    key = authorization.removeprefix("Bearer ").strip()
    return hashlib.sha256(key.encode("utf-8", "replace")).hexdigest()[:32] if key else ""


def install_error_handlers(app: Starlette) -> None:
    """OpenAI-style error bodies for APIError and Starlette's own HTTP errors; a client that left
    gets the non-standard 499 (nobody reads it, but access logs say what happened)."""
    from starlette.exceptions import HTTPException

    from meshserve.api.sse import ClientDisconnected

    # Starlette types every handler as taking any Exception; each gets only the class it is
    # registered for.
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers is not None else None
        return error_response(APIError(exc.status_code, str(exc.detail), headers=headers))

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientDisconnected, gone)
