"""GatewayConfig: every gateway setting, validated once at the edge."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from meshserve.routing.policies import POLICIES, CacheAwareConfig
from meshserve.utils.checks import check_range

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class GatewayConfig:
    backends: list[str]  # colocated replicas: each computes its own requests' prompts
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    # Health: probes, and how long reported load figures stay trustworthy.
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    stale_after_s: float = 5.0  # figures older than this: the replica counts as saturated
    breaker_failures: int = 3  # consecutive failures (timeouts, 5xx) that open a replica's breaker
    breaker_cooldown_s: float = 1.0  # open -> half-open (doubles on each failed half-open probe)
    breaker_max_cooldown_s: float = 30.0
    connect_timeout_s: float = 2.0
    # A replica answers reservations between steps: this must outlast its longest step (a long
    # prompt on a CPU takes seconds), or a busy replica reads as failed.
    reservation_timeout_s: float = 10.0
    first_token_timeout_s: float = 300.0  # an attempt with no output for this long has failed
    # Failure protocol.
    retry_budget_ratio: float = 0.1  # retries allowed per request routed, fleet-wide
    retry_budget_min: int = 10  # retries always available (a quiet gateway may still retry)
    resume_streams: bool = False
    # Admission.
    lease_ttl_s: float = 10.0  # an unused reservation ends this long after it was granted
    max_queued: int = 1024  # requests waiting for admission; beyond: 429
    max_queue_wait_s: float = 30.0  # the deadline of a request that names none
    # A waiting request that did not fit may be passed by later ones that do, until it has waited
    # this long; then nothing passes it, so the capacity that frees goes to it.
    skip_ahead_age_s: float = 5.0
    max_prompts_per_request: int = 64  # prompts in one /v1/completions batch, checked before tokenizing
    tokenize_concurrency: int = 8  # /tokenize calls one request's prompts may have open at once
    max_upstream_connections: int = 512  # the pool to the replicas; more requests wait for a connection
    tenants_file: str | None = None
    api_key: str | None = None  # without a tenants file: one key for everyone (or none)
    backend_api_key: str | None = None  # sent to the replicas (their --api-key)
    metrics_api_key: str | None = None  # opens /metrics (beside the clients' keys)
    # Observability.
    trace_file: str | None = None  # spans as JSON lines
    otlp_endpoint: str | None = None  # spans over OTLP/HTTP
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    # Disaggregated prefill/decode (disagg.py): client requests go to decode (and colocated) replicas;
    # prefill replicas only compute prompts whose KV they hand to a decode replica.
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    disagg_min_tokens: int = 256  # split only when the decode replica lacks more of the prompt than this

    def __post_init__(self) -> None:
        if not self.backends and not (self.prefill and self.decode):
            raise ValueError("give at least one --backend URL, or --prefill with --decode URLs")
        if bool(self.prefill) != bool(self.decode):  # a half pool could never split a request
            raise ValueError("--prefill needs at least one --decode URL, and --decode at least one --prefill URL")
        self.backends = _urls("--backend", self.backends)
        self.decode = _urls("--decode", self.decode)
        self.prefill = _urls("--prefill", self.prefill)
        pools = {"--backend": self.backends, "--decode": self.decode, "--prefill": self.prefill}
        owner = {url: flag for flag, urls in pools.items() for url in urls}
        for flag, urls in pools.items():
            for url in urls:
                if owner[url] != flag:  # one replica with two jobs would take clients and hand-offs alike
                    raise ValueError(f"{url} is given to both {flag} and {owner[url]}: a replica is in one pool")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        check_range("--port", self.port, 0, 65535)
        check_range("--probe-interval", self.probe_interval_s, 0.05, 600)
        check_range("--probe-timeout", self.probe_timeout_s, 0.05, 600)
        check_range("--stale-after", self.stale_after_s, 2 * self.probe_interval_s, 3600)
        check_range("--breaker-failures", self.breaker_failures, 1, 1000)
        check_range("--breaker-cooldown", self.breaker_cooldown_s, 0.05, 3600)
        check_range("--breaker-max-cooldown", self.breaker_max_cooldown_s, self.breaker_cooldown_s, 3600)
        check_range("--connect-timeout", self.connect_timeout_s, 0.05, 600)
        check_range("--first-token-timeout", self.first_token_timeout_s, 0.1, 86400)
        check_range("--retry-budget-ratio", self.retry_budget_ratio, 0.0, 1.0)
        check_range("--retry-budget-min", self.retry_budget_min, 0, 100000)
        check_range("--lease-ttl", self.lease_ttl_s, 0.1, 3600)
        check_range("--max-queued", self.max_queued, 1, 1_000_000)
        check_range("--max-queue-wait", self.max_queue_wait_s, 0.01, 86400)
        check_range("--max-body-bytes", self.max_body_bytes, 1024, 1 << 30)
        check_range("--reservation-timeout", self.reservation_timeout_s, 0.05, 600)
        check_range("--skip-ahead-age", self.skip_ahead_age_s, 0, 86400)
        check_range("--max-prompts-per-request", self.max_prompts_per_request, 1, 4096, integer=True)
        check_range("--tokenize-concurrency", self.tokenize_concurrency, 1, 1024, integer=True)
        check_range("--max-upstream-connections", self.max_upstream_connections, 1, 100_000, integer=True)
        check_range("--disagg-min-tokens", self.disagg_min_tokens, 0, integer=True)
        if self.api_key is not None and self.tenants_file is not None:
            raise ValueError("give --api-key or --tenants, not both (tenants carry their own keys)")
        for name, key in (("--api-key", self.api_key), ("--backend-api-key", self.backend_api_key),
                          ("--metrics-api-key", self.metrics_api_key)):
            if key is not None and not key.strip():
                raise ValueError(f"{name} must not be empty")

    @property
    def pools(self) -> list[tuple[str, str]]:
        """(url, pool) of every replica, in the order their indexes follow."""
        return ([(u, "backend") for u in self.backends] + [(u, "decode") for u in self.decode]
                + [(u, "prefill") for u in self.prefill])


def _urls(flag: str, urls: list[str]) -> list[str]:
    out = [u.rstrip("/") for u in urls]
    for url in out:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{flag} must be an http(s) URL such as http://127.0.0.1:8001, got {url!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"{flag} lists the same URL twice")
    return out
