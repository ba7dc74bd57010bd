"""Tenants: API keys map to a tenant with a concurrency limit and a token-rate quota.

The quota is a token bucket: a request takes prompt + max_tokens tokens when it is admitted (what it
may cost at most) and gives back what it did not use when it ends (settled to the real count). A
request over its tenant's concurrency or quota gets 429 with Retry-After at once; it never waits.

The tenants file is TOML:

    [[tenant]]
    name = "team-a"
    api_keys = ["sk-team-a-1"]
    max_concurrency = 8          # requests in flight at once (default: unlimited)
    tokens_per_second = 2000     # quota refill rate (default: unlimited)
    burst_tokens = 16000         # bucket size (default: 10 s worth of tokens_per_second)
"""
from __future__ import annotations

import hmac
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field

from meshserve.api.errors import APIError

DEFAULT_TENANT = "default"
_EPSILON = 1e-6


@dataclass
class TenantConfig:
    name: str
    api_keys: list[str] = field(default_factory=list)
    max_concurrency: int | None = None
    tokens_per_second: float | None = None
    burst_tokens: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum() or len(self.name) > 64:
            raise ValueError(f"tenant name must be 1-64 letters, digits, '-' or '_', got {self.name!r}")
        if self.max_concurrency is not None and not 1 <= self.max_concurrency <= 1_000_000:
            raise ValueError(f"tenant {self.name}: max_concurrency must be in [1, 1000000], got {self.max_concurrency}")
        if self.tokens_per_second is not None and not 0 < self.tokens_per_second <= 1e9:
            raise ValueError(f"tenant {self.name}: tokens_per_second must be in (0, 1e9], got {self.tokens_per_second}")
        if self.burst_tokens is not None and not 1 <= self.burst_tokens <= 1e12:
            raise ValueError(f"tenant {self.name}: burst_tokens must be in [1, 1e12], got {self.burst_tokens}")
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError(f"tenant {self.name}: api_keys must be non-empty strings")


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.capacity, self._clock = rate, capacity, clock
        self.tokens = capacity
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now

    def take(self, n: float) -> float:
        """Take n tokens; 0.0 on success, else the seconds until they would be there (nothing taken)."""
        self._refill()
        if n <= self.tokens + _EPSILON:  # (the wait it said to wait is enough, despite rounding)
            self.tokens = max(0.0, self.tokens - n)
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - self.tokens) / self.rate

    def give_back(self, n: float) -> None:
        self._refill()
        self.tokens = min(self.capacity, self.tokens + n)


class Tenant:
    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        self.name = config.name
        self.in_flight = 0
        rate = config.tokens_per_second
        self.bucket = None if rate is None else TokenBucket(rate, config.burst_tokens or rate * 10)

    def admit(self, tokens: int) -> None:
        """Take a concurrency slot and `tokens` of quota, or raise 429 with Retry-After."""
        limit = self.config.max_concurrency
        if limit is not None and self.in_flight >= limit:
            raise APIError(429, f"tenant {self.name} has {limit} requests in flight, its limit",
                           code="concurrency_limit", headers={"Retry-After": "1"})
        if self.bucket is not None:
            wait = self.bucket.take(tokens)
            if wait == math.inf:
                raise APIError(429, f"the request may use {tokens} tokens, more than tenant {self.name}'s burst "
                               f"of {self.bucket.capacity:g}", code="quota_exceeded", headers={"Retry-After": "60"})
            if wait > 0:
                raise APIError(429, f"tenant {self.name} is over its token quota "
                               f"({self.config.tokens_per_second:g} tokens/s)", code="quota_exceeded",
                               headers={"Retry-After": str(max(1, math.ceil(wait)))})
        self.in_flight += 1

    def settle(self, reserved_tokens: int, used_tokens: int) -> None:
        """The request ended having used `used_tokens` of the `reserved_tokens` it took."""
        self.in_flight -= 1
        if self.bucket is not None and used_tokens < reserved_tokens:
            self.bucket.give_back(reserved_tokens - used_tokens)


class Tenants:
    """API key -> tenant. Without a file: one tenant, and the key (if any) is checked."""

    def __init__(self, tenants: list[TenantConfig], open_key: str | None = None) -> None:
        self.by_name = {t.name: Tenant(t) for t in tenants} or {DEFAULT_TENANT: Tenant(TenantConfig(DEFAULT_TENANT))}
        self._keys = [(k, self.by_name[t.name]) for t in tenants for k in t.api_keys]
        self._open_key = open_key
        if len({k for k, _ in self._keys}) != len(self._keys):
            raise ValueError("the tenants file gives one API key to two tenants")

    @classmethod
    def from_file(cls, path: str) -> Tenants:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--tenants {path}: {exc}") from None
        entries = data.get("tenant")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"--tenants {path}: expected one or more [[tenant]] tables")
        known = {"name", "api_keys", "max_concurrency", "tokens_per_second", "burst_tokens"}
        for entry in entries:
            unknown = set(entry) - known
            if unknown:
                raise ValueError(f"--tenants {path}: unknown key(s) {sorted(unknown)} (known: {sorted(known)})")
            if not entry.get("api_keys"):  # a tenant nobody can authenticate as: a mistake in the file
                raise ValueError(f"--tenants {path}: tenant {entry.get('name')!r} has no api_keys; "
                                 "give each tenant at least one key")
        return cls([TenantConfig(**entry) for entry in entries])

    @property
    def has_keys(self) -> bool:
        """Clients must present a key (a tenants file, or --api-key)."""
        return bool(self._keys) or self._open_key is not None

    def authenticate(self, authorization: str) -> Tenant:
        """The tenant whose key the `Authorization: Bearer KEY` header carries, or 401."""
        given = authorization.removeprefix("Bearer ").strip()
        if self._keys:
            for key, tenant in self._keys:
                if hmac.compare_digest(given.encode(), key.encode()):
                    return tenant
            raise APIError(401, "missing or unknown API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        if self._open_key is not None and not hmac.compare_digest(given.encode(), self._open_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        return self.by_name[DEFAULT_TENANT]
