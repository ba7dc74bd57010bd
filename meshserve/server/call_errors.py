"""The HTTP answer to a failed engine call about leases and hand-offs, in one place for both
routes (server/reservations.py, server/kv_transfers.py)."""
from __future__ import annotations

from meshserve.api.errors import APIError
from meshserve.engine.errors import EngineCallError, EngineDeadError


def lease_call_error(exc: EngineCallError | EngineDeadError, unsupported_code: str) -> APIError:
    """The engine gone: 503, try again later. Otherwise the engine refused the call: the feature or
    role is off here (501, `unsupported_code`), the lease is unknown to the caller (404), the key
    holds its most leases (429), or the input is bad (400); never the replica's fault."""
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"})
    if exc.unsupported:
        return APIError(501, str(exc), code=unsupported_code)
    if exc.not_found:
        return APIError(404, str(exc), code="reservation_not_found")
    if exc.limit:
        return APIError(429, f"{exc} (--max-leases-per-key)", code="too_many_reservations",
                        headers={"Retry-After": "1"})
    return APIError(400, str(exc), code="invalid_parameter")
