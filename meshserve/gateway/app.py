"""The gateway's HTTP face: the OpenAI routes, and each request's way through it.

A completion or chat request is parsed and checked (API key -> tenant, deadline), its prompt is
tokenized fully rendered by a replica's /tokenize (so the context check and the prefix index see
exactly the ids the engine will), the tenant's quota is taken, and then the failure protocol places
and sends it (failover.py). Nothing reaches a replica's engine before the request fits its context
and its tenant's quota.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from fastapi import FastAPI
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

import meshserve
from meshserve.api.errors import APIError, error_body
from meshserve.api.json_body import parse, read_json
from meshserve.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, resolve_max_tokens
from meshserve.api.middleware import (
    SERVER_KEEP_ALIVE_S,
    UPSTREAM_KEEP_ALIVE_S,
    RequestContextMiddleware,
    install_error_handlers,
)
from meshserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from meshserve.api.sse import (
    EventStreamResponse,
    JSONBytesResponse,
    cancel_on_disconnect,
)
from meshserve.gateway.admission import DEADLINE_HEADER, Admission, Deadline
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.failover import FailureProtocol
from meshserve.gateway.intake import Tokenizing, check_capacity, check_request, check_token_ids
from meshserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from meshserve.gateway.replicas import Replica, ReplicaSet
from meshserve.gateway.request import GatewayRequest
from meshserve.gateway.reserver import Reserver
from meshserve.gateway.tenants import Tenants
from meshserve.gateway.tracing import Tracing, setup_tracing
from meshserve.gateway.upstream import Attempt
from meshserve.routing.policies import make_policy
from meshserve.sampling_params import is_greedy

logger = logging.getLogger(__name__)


class Gateway:
    """Everything one gateway process holds; built inside the event loop (start) and closed by stop."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tenants = Tenants.from_file(config.tenants_file) if config.tenants_file else Tenants([], config.api_key)
        self.policy = make_policy(config.policy, config.cache_aware)
        self.tracing = Tracing(setup_tracing(config.trace_file, config.otlp_endpoint))
        self._turn = itertools.count()

    async def start(self) -> None:
        cfg = self.config
        # Every call to a replica carries the backend key; the pool is bounded (a request beyond it
        # waits for a connection), so no burst of requests opens connections without limit.
        headers = {"Authorization": f"Bearer {cfg.backend_api_key}"} if cfg.backend_api_key else None
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_upstream_connections, keepalive_timeout=UPSTREAM_KEEP_ALIVE_S),
            raise_for_status=False, headers=headers)
        self.replicas = ReplicaSet(cfg, self.session)
        self.tokenizing = Tokenizing(cfg, self.session, self.replicas)
        self.metrics = GatewayMetrics(lambda: self.replicas.replicas, lambda: self.admission.waiting)
        self.reserver = Reserver(self.session, cfg)
        self.admission = Admission(cfg, self.replicas, self.policy, self.reserver,
                                   on_refused=lambda r: self.metrics.lease_refusals.labels(r.label).inc())
        self.protocol = FailureProtocol(cfg, self.session, self.replicas, self.admission, self.reserver,
                                        self.metrics, self.tracing)
        self.replicas.on_cache_lost = self._cache_lost
        self.replicas.on_breaker_opened = self._breaker_opened
        await self.replicas.probe_all()
        self.replicas.start()
        self.admission.start()

    async def stop(self) -> None:
        await self.admission.stop()
        await self.replicas.stop()
        await self.protocol.disagg.stop()
        await self.session.close()
        self.tracing.shutdown()

    def _cache_lost(self, replica: Replica) -> None:
        self.policy.forget_replica(replica.index)

    def _breaker_opened(self, replica: Replica) -> None:
        """No new work goes there; its unused leases are given up (reconciled with its ledger when it
        answers). A running attempt keeps its own: ending it would end its request there."""
        for lease in list(replica.leases.values()):
            if not lease.in_use:
                asyncio.get_running_loop().create_task(self.reserver.release(replica, lease))

    # ---- the request's way ----------------------------------------------------------------
    async def handle(self, request: Request, endpoint: str) -> Response:
        arrival = time.monotonic()
        request_id = request.state.request_id
        chat = endpoint.endswith("/chat/completions")
        try:  # who asks comes first: a client without a key learns nothing, not even what is wrong
            tenant = self.tenants.authenticate(request.headers.get("authorization", ""))
        except APIError as exc:
            self.metrics.rejections.labels(exc.code or str(exc.status), "unknown").inc()
            raise
        tenant_name = tenant.name
        raw = await read_json(request, self.config.max_body_bytes)
        req = parse(ChatCompletionRequest, raw) if chat else parse(CompletionRequest, raw)
        span = self.tracing.tracer.start_span(f"POST {endpoint}", context=Tracing.incoming(request.headers),
                                              attributes={"meshserve.request_id": request_id,
                                                          "gen_ai.request.model": req.model or ""})
        try:
            with self.tracing.tracer.start_as_current_span("admission", context=trace.set_span_in_context(span)):
                check_request(req, self.config)  # before anything is tokenized or queued
                deadline = Deadline.from_header(request.headers.get(DEADLINE_HEADER), self.config.max_queue_wait_s)
                like, prompts, max_model_len = await self.tokenizing.prompts(req, raw)
                check_token_ids(prompts, like)
                prompt_tokens = sum(len(p) for p in prompts)
                requested = (req.max_completion_tokens if isinstance(req, ChatCompletionRequest)
                             and req.max_completion_tokens is not None else req.max_tokens)
                max_tokens = min(resolve_max_tokens(requested, len(p), max_model_len,
                                                    None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS) for p in prompts)
                check_capacity(self.replicas.compatible(like.model, like), prompts, max_tokens, req.n)
                quota = prompt_tokens + max_tokens * req.n * len(prompts)
                tenant.admit(quota)
        except APIError as exc:
            self.metrics.rejections.labels(exc.code or str(exc.status), tenant_name).inc()
            span.set_attribute("meshserve.outcome", f"rejected: {exc.code}")
            span.end()
            raise
        except BaseException:
            span.end()
            raise
        span.set_attributes({"meshserve.tenant": tenant.name, "meshserve.prompt_tokens": prompt_tokens,
                             "meshserve.max_tokens": max_tokens})
        greq = GatewayRequest(request_id, endpoint, raw, tenant, like, prompts[0], prompt_tokens, max_tokens, req.n,
                              deadline, arrival, span, reservable=len(prompts) == 1,
                              resumable=_resumable(req, len(prompts)), quota=quota,
                              cache_salt=tenant_cache_salt(tenant.name, req.cache_salt))
        return await cancel_on_disconnect(request, self._serve(greq))

    async def _serve(self, greq: GatewayRequest) -> Response:
        handed_over = False
        try:
            if not greq.stream:
                answer = await self.protocol.complete(greq)
                return JSONBytesResponse(answer)
            attempt = await self.protocol.start(greq)
            self.metrics.ttft.observe(time.monotonic() - greq.arrival)
            handed_over = True
            return EventStreamResponse(self._stream(greq, attempt))
        except APIError as exc:
            greq.outcome = f"error {exc.status}"
            exc.request_id = exc.request_id or (greq.request_id if exc.status >= 500 else None)
            raise
        except asyncio.CancelledError:
            greq.outcome = "cancelled"
            raise
        finally:
            if not handed_over:
                self._close(greq)

    async def _stream(self, greq: GatewayRequest, attempt: Attempt) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self.protocol.relay(greq, attempt):
                yield chunk
        finally:
            self._close(greq)

    def _close(self, greq: GatewayRequest) -> None:
        greq.tenant.settle(greq.quota, _charged(greq))
        self.metrics.requests.labels(greq.outcome.split(" ")[0]).inc()
        greq.span.set_attributes({"meshserve.outcome": greq.outcome, "meshserve.attempts": greq.attempts,
                                  "meshserve.completion_tokens": greq.completion_tokens})
        greq.span.end()

    def authenticate(self, request: Request, metrics: bool = False) -> None:
        """401 unless the request carries a client's key (any key opens every route of an open
        gateway but /health); /metrics also takes --metrics-api-key."""
        given = request.headers.get("authorization", "")
        key = self.config.metrics_api_key
        if metrics and key is not None and hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return
        if metrics and key is not None and not self.tenants.has_keys:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        self.tenants.authenticate(given)

    # ---- pass-through and fleet views -------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        """/tokenize and /detokenize: answered by any healthy replica."""
        candidates = self.replicas.compatible(None)
        if not candidates:
            raise APIError(503, "no healthy replica", code="no_healthy_replica", headers={"Retry-After": "2"})
        replica = candidates[next(self._turn) % len(candidates)]
        body = await read_json(request, self.config.max_body_bytes)
        try:
            async with self.session.post(replica.url + path, json=body) as resp:
                return Response(await resp.read(), status_code=resp.status, media_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.replicas.record_failure(replica, f"{path}: {type(exc).__name__}",
                                         decisive=isinstance(exc, aiohttp.ClientConnectorError))
            raise APIError(503, f"the replica did not answer ({type(exc).__name__})", code="no_healthy_replica",
                           headers={"Retry-After": "1"}) from None

    def models(self) -> dict:
        seen: dict[str, dict[str, Any]] = {}
        for r in self.replicas.replicas:
            if r.identity is not None and r.identity.model not in seen:
                seen[r.identity.model] = {"id": r.identity.model, "object": "model", "owned_by": "meshserve",
                                          "max_model_len": r.identity.max_model_len, "revision": r.identity.revision}
        return {"object": "list", "data": list(seen.values())}

    def fleet(self) -> dict:
        now = time.monotonic()
        out = []
        for r in self.replicas.replicas:
            load, saturated = r.routing_load(now, self.config.stale_after_s, self.config.cache_aware.slack_requests)
            out.append({"url": r.url, "pool": r.pool, "healthy": r.healthy, "breaker": r.breaker.state.name.lower(),
                        "breaker_opened": r.breaker.times_opened, "last_error": r.last_error,
                        "ledger": vars(r.ledger), "reserved_blocks": r.reserved_blocks, "leases": len(r.leases),
                        "reported": vars(r.reported) if r.reported else None,
                        "report_age_s": round(now - r.reported_at, 3) if r.reported else None,
                        "saturated": saturated, "routing_load": vars(load),
                        "identity": vars(r.identity) if r.identity else None})
        return {"policy": self.policy.name, "queue_waiting": self.admission.waiting,
                "retry_budget": round(self.protocol.budget.balance, 2), "replicas": out}


def _charged(greq: GatewayRequest) -> int:
    """Tokens the tenant pays for a request that ended: what was computed (its prompt, once a replica
    took it, and what it generated), nothing when the gateway refused it itself. A whole answer cut
    off by its client's leaving cost an unknown share of its budget: the whole budget."""
    if greq.attempts == 0:
        return 0
    if greq.outcome == "cancelled" and not greq.stream:
        return greq.quota
    return min(greq.quota, greq.prompt_tokens + greq.completion_tokens)


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The cache salt the replicas get: the tenant's own scope (a client's salt can only narrow it),
    so no tenant's prompt ever hits blocks another tenant's requests cached."""
    key = f"meshserve-tenant\0{tenant}\0{client_salt or ''}".encode()
    return hashlib.sha256(key).hexdigest()[:32]


def _resumable(req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> bool:
    """Can a continuation on another replica give the same answer (see failover.py)? Not with stop
    strings (text held back at the seam for one would be matched by neither attempt), nor with a
    constraint on the output or tools (the continuation's parser would start from scratch)."""
    asks_logprobs = (req.logprobs if isinstance(req, ChatCompletionRequest)
                     else req.logprobs is not None or req.echo)
    reproducible = is_greedy(req.temperature) or req.seed is not None
    constrained = (req.structured_outputs is not None or getattr(req, "tools", None)
                   or (req.response_format is not None and req.response_format.type != "text"))
    return (bool(req.stream) and req.n == 1 and num_prompts == 1 and reproducible and not req.stop
            and not constrained
            and not req.frequency_penalty and not req.presence_penalty and not asks_logprobs)


def build_app(gateway: Gateway) -> FastAPI:
    app = FastAPI(title="meshserve gateway", version=meshserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    # Keys are the tenants' business (Gateway.handle); the middleware adds X-Request-Id and bounds bodies.
    app.add_middleware(RequestContextMiddleware, api_key=None, max_body_bytes=gateway.config.max_body_bytes)

    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway.authenticate(request)
        return JSONBytesResponse(gateway.models())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        gateway.authenticate(request)
        return await gateway.forward(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        gateway.authenticate(request)
        return await gateway.forward(request, "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        """200 while some replica takes work ("ok", or "degraded" when some do not); 503 when none."""
        replicas = gateway.replicas.replicas
        healthy = sum(r.healthy for r in replicas)
        serving = any(r.healthy and r.takes_clients for r in replicas)  # a prefill replica alone serves nobody
        state = {"status": "unavailable" if not serving else "ok" if healthy == len(replicas) else "degraded",
                 "replicas": len(replicas), "replicas_healthy": healthy}
        if not serving:
            body = error_body(503, "no replica that takes requests is healthy", code="no_healthy_replica")
            return JSONBytesResponse({**body, **state}, status_code=503, headers={"Retry-After": "2"})
        return JSONBytesResponse(state)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway.authenticate(request, metrics=True)
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/gateway/replicas")
    async def fleet(request: Request) -> Response:
        gateway.authenticate(request)
        return JSONBytesResponse(gateway.fleet())

    return app


async def serve(config: GatewayConfig) -> int:
    """Run the gateway until SIGTERM/SIGINT (blocking coroutine)."""
    import uvicorn

    gateway = Gateway(config)
    await gateway.start()
    try:
        server = uvicorn.Server(uvicorn.Config(build_app(gateway), host=config.host, port=config.port,
                                               log_level=config.log_level, lifespan="off",
                                               timeout_keep_alive=SERVER_KEEP_ALIVE_S, timeout_graceful_shutdown=30))
        logger.info("gateway on http://%s:%d in front of %s (policy %s)", config.host, config.port,
                    ", ".join(f"{url} ({pool})" for url, pool in config.pools), config.policy)
        await server.serve()
    finally:
        await gateway.stop()
    return 0
