"""The load figures a replica reports on every response, and how a router reads them.

A replica sends them in the `X-Meshserve-Load` header when a response starts (for a stream: with its
first output) and again in an SSE comment line (`: load ...`) just before `data: [DONE]`, which SSE
clients ignore. The value is `key=value` pairs joined by `;`, numbers only, e.g.
`running=3;waiting=1;pending_prefill=120;free_blocks=40;blocks=64;reserved_blocks=8;kv=0.375`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

LOAD_HEADER = "X-Meshserve-Load"
SSE_LOAD_PREFIX = b": load "


@dataclass(frozen=True)
class ReportedLoad:
    running: int = 0  # sequences in the running batch
    waiting: int = 0  # sequences waiting to be scheduled (and requests not yet handed to the engine)
    pending_prefill: int = 0  # prompt tokens admitted or waiting that are not computed yet
    free_blocks: int = 0
    blocks: int = 0
    reserved_blocks: int = 0  # promised to leases
    kv: float = 0.0  # share of KV blocks in use


_FIELDS = {f.name: f.type for f in fields(ReportedLoad)}


def format_load(load: ReportedLoad) -> str:
    parts = []
    for name in _FIELDS:
        value = getattr(load, name)
        parts.append(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={int(value)}")
    return ";".join(parts)


def parse_load(text: str) -> ReportedLoad | None:
    """None for a value that is not a load report (unknown keys are skipped: newer replicas)."""
    values: dict[str, Any] = {}  # ReportedLoad's keyword arguments, an int or a float each
    for part in text.split(";"):
        key, sep, raw = part.strip().partition("=")
        if not sep or key not in _FIELDS:
            continue
        try:
            values[key] = float(raw) if key == "kv" else int(raw)
        except ValueError:
            return None
    return ReportedLoad(**values) if values else None
