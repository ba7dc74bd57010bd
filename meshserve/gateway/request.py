"""One client request as the gateway carries it through admission, attempts and failures."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from meshserve.gateway.admission import Deadline
from meshserve.gateway.replicas import ReplicaIdentity
from meshserve.gateway.tenants import Tenant


@dataclass
class GatewayRequest:
    request_id: str
    endpoint: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's, as sent
    tenant: Tenant
    like: ReplicaIdentity  # the replica that tokenized the prompt
    prompt_ids: list[int]  # the (first) prompt, fully rendered
    prompt_tokens: int  # over all prompts
    max_tokens: int  # per sample
    n: int
    deadline: Deadline
    arrival: float
    span: trace.Span
    reservable: bool  # one prompt: a lease can cover it
    resumable: bool
    quota: int = 0  # tokens taken from the tenant's bucket
    completion_tokens: int = 0
    outcome: str = "ok"
    attempts: int = 0  # sent to a replica this many times (0: the gateway refused it itself)
    exclude: set[int] = field(default_factory=set)
    cache_salt: str = ""  # its prefix-cache scope on the replicas (its tenant's)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")
