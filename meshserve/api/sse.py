"""Server-sent events and client-disconnect handling.

A generation must stop the moment its client leaves, whether it is still waiting for its first token
(no response started yet) or streaming: both paths end by cancelling the task that awaits the
engine's output, and that cancellation aborts the request in the engine.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class JSONBytesResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


class EventStreamResponse(StreamingResponse):
    """StreamingResponse that always watches for the client leaving and always closes its iterator,
    so the generator's clean-up (the engine abort) runs at once rather than when it is collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})
        self._content = content  # body_iterator, typed as the generator it is (to close it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                stream = tg.create_task(self.stream_response(send))
                watcher = tg.create_task(_wait_disconnect(receive))
                done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
                for task in (stream, watcher):
                    if task not in done:
                        task.cancel()
        except* OSError:
            pass  # the client left while we were writing
        finally:
            await self._content.aclose()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client went away before the response started."""


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (call after the body was read)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or we are cancelled ourselves)
            task.cancel()
            await asyncio.wait({task})  # let its clean-up, the engine abort, run now
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
