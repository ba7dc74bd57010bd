"""A replica that says it is meshserve (reservations, a block size, load reports) and answers as a
test tells it to: a 4xx or a malformed grant for reservations, 5xx or 429 completions, a body that
stalls, slow /tokenize calls (counting how many were open at once). In-process, on a loopback port."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshserve.api.load import LOAD_HEADER
from meshserve.utils.server_process import free_port
from tests.gateway.fleet import wait_until

MODEL = "fake-model"
LOAD = "running=0;waiting=0;pending_prefill=0;free_blocks=64;blocks=64;reserved_blocks=0;kv=0"


@dataclass
class Behaviour:
    reservation: tuple[int, object] = (201, None)  # status and body (None: a well-formed grant)
    completion: int = 200  # status of /v1/completions answers
    stall_body: bool = False  # send the headers of a completion, then never the body
    tokenize_delay_s: float = 0.0


@dataclass
class Seen:
    tokenize_calls: int = 0
    tokenize_open_max: int = 0
    reservations: int = 0
    completions: int = 0
    authorization: list[str] = field(default_factory=list)


class FakeReplica:
    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.seen = Seen()
        self._open = 0
        self._leases = 0
        app = Starlette(routes=[
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/server_info", self.server_info),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/reservations", self.reserve, methods=["POST", "GET"]),
            Route("/v1/reservations/{lease}", self.release, methods=["DELETE"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _json(self, body: object, status: int = 200) -> Response:
        return JSONResponse(body, status_code=status, headers={LOAD_HEADER: LOAD})

    async def health(self, request: Request) -> Response:
        return self._json({"status": "ok", "restarts": 0})

    async def models(self, request: Request) -> Response:
        return self._json({"data": [{"id": MODEL, "max_model_len": 256, "revision": "r", "block_size": 16,
                                     "tokenizer_hash": "t", "chat_template_hash": "c"}]})

    async def server_info(self, request: Request) -> Response:
        return self._json({"reservations": True, "model": {"id": MODEL, "vocab_size": 1000}})

    async def tokenize(self, request: Request) -> Response:
        self.seen.tokenize_calls += 1
        self._open += 1
        self.seen.tokenize_open_max = max(self.seen.tokenize_open_max, self._open)
        try:
            await asyncio.sleep(self.behaviour.tokenize_delay_s)
            body = await request.json()
            return self._json({"tokens": [1 + ord(c) % 900 for c in body["prompt"]], "count": 1,
                               "max_model_len": 256})
        finally:
            self._open -= 1

    async def detokenize(self, request: Request) -> Response:
        return self._json({"prompt": "x"})

    async def reserve(self, request: Request) -> Response:
        if request.method == "GET":
            return self._json({"leases": []})
        self.seen.reservations += 1
        self.seen.authorization.append(request.headers.get("authorization", ""))
        status, body = self.behaviour.reservation
        if body is None:
            self._leases += 1
            body = {"lease_id": f"0.lease{self._leases}", "blocks": 2, "pinned_blocks": 0}
        return self._json(body, status)

    async def release(self, request: Request) -> Response:
        return self._json({"released": True})

    async def completions(self, request: Request) -> Response:
        self.seen.completions += 1
        status = self.behaviour.completion
        if status != 200:
            return self._json({"error": {"message": "no", "type": "x", "param": None, "code": "fake"}}, status)
        if self.behaviour.stall_body:
            async def never():
                yield b'{"id": "x", '
                await asyncio.sleep(3600)
            return StreamingResponse(never(), media_type="application/json", headers={LOAD_HEADER: LOAD})
        return self._json({"id": "x", "object": "text_completion", "model": MODEL,
                           "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    def __enter__(self) -> FakeReplica:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the fake replica")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(10)
