"""How a request or a call to the engines ends badly, as the front end sees it."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine serving this request stopped (or none is running)."""


class EngineRejectedError(ValueError):
    """The engine refused one request (its message names the parameter)."""


class EngineRequestFailed(RuntimeError):
    """The request ended early, the engine serving on: a step it was in raised, the lease it drew
    on was released, or its client stopped reading. `code` says which (an ErrorCode's value, or
    STREAM_BACKLOG)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


STREAM_BACKLOG = "stream_backlog"  # EngineRequestFailed.code: the client stopped reading


class EngineCallError(ValueError):
    """The engine refused a call (its message says why: an unknown lease, a lease that cannot
    cover the request). `unsupported`: the engine has no reservations at all; `limit`: the caller
    holds as many leases as it may; `not_found`: the lease it names does not exist."""

    def __init__(self, message: str, unsupported: bool = False, limit: bool = False, not_found: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported
        self.limit = limit
        self.not_found = not_found
