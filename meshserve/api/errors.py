"""OpenAI-style errors: one exception type for every rejection, one JSON shape for every error body."""
from __future__ import annotations

from dataclasses import fields
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from meshserve.sampling_params import SamplingParams

# The `type` field per status, following the OpenAI API's vocabulary.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

_PARAMS = {f.name for f in fields(SamplingParams)} | {"prompt", "messages", "model"}


class APIError(Exception):
    """A request the server refuses or cannot serve; becomes `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 type: str | None = None, request_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.type = type
        self.request_id = request_id

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code, type=self.type,
                          request_id=self.request_id)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type: str | None = None, request_id: str | None = None) -> dict[str, Any]:
    """`request_id` is added for failures a client may want to report (the server's, not theirs)."""
    kind = type or _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")
    err = {"message": message, "type": kind, "param": param,
           "code": code if code is not None else HTTPStatus(status).phrase.lower().replace(" ", "_")}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


def bad_request(message: str, param: str | None = None, code: str = "invalid_parameter") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its location in the body."""
    first = exc.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"]]
    where = ".".join(loc) or "body"
    if first["type"] == "extra_forbidden":
        message = f"unknown field {where!r}"
    else:
        message = f"{where}: {first['msg']}"
        if first.get("input") is not None and first["type"] not in ("missing",):
            message += f" (got {_short(first['input'])})"
    return bad_request(message, param=loc[0] if loc else None)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams and the engine name the offending parameter first: `max_tokens must be ...`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in _PARAMS else None)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
