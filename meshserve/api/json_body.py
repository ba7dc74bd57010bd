"""Reading a JSON request body: bounded in size, strict about UTF-8 and JSON, validated by a model."""
from __future__ import annotations

import json
from typing import Any, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from meshserve.api.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _check_strings(obj: Any) -> None:
    """Reject lone surrogates (JSON escapes like \\ud800): they cannot be encoded as UTF-8."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())


async def read_json(request: Request, limit: int) -> Any:
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        obj = json.loads(b"".join(chunks).decode("utf-8"), parse_constant=_reject_constant)
        _check_strings(obj)
    except (UnicodeDecodeError, UnicodeEncodeError) as exc:  # bad bytes; a lone surrogate
        raise bad_request(f"request body is not valid UTF-8: {exc.reason}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError and the constants above
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    return obj


def parse(model: type[M], obj: Any) -> M:
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
