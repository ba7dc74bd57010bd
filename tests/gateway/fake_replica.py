"""A replica that says it is meshserve (reservations, a block size, load reports) and answers as a
test tells it to: a 4xx or a malformed grant for reservations, 5xx or 429 completions, a body that
stalls, slow /tokenize calls (counting how many were open at once). In-process, on a loopback port.

It also plays either leg of a KV hand-off (a `kv_role` in /server_info): as a decode replica it
answers `POST /v1/kv/transfers` with a descriptor (or the status a test sets); as a prefill replica
it answers a completion carrying `kv_transfer_params` with `kv_transfer` (or a 5xx/4xx, a delay, a
malformed answer); either records the `DELETE /v1/kv/transfers/{id}` aborts it got."""
from __future__ import annotations

import asyncio
import json
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
    kv_role: str | None = None  # in /server_info (None: not said, as a replica before roles)
    transfer: tuple[int, object] = (201, None)  # decode leg: status and body (None: a descriptor)
    transfer_blocks: int | None = None  # blocks a descriptor names (None: the prompt's full blocks)
    prefill: tuple[int, object] = (200, None)  # prefill leg: status and body (None: a completed transfer)
    prefill_delay_s: float = 0.0


@dataclass
class Seen:
    tokenize_calls: int = 0
    tokenize_open_max: int = 0
    reservations: int = 0
    completions: int = 0  # client requests (not prefill legs)
    authorization: list[str] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)  # granted
    releases: list[str] = field(default_factory=list)
    completion_bodies: list[dict] = field(default_factory=list)
    completion_leases: list[str | None] = field(default_factory=list)  # X-Reservation-Id of each
    transfers: list[dict] = field(default_factory=list)  # POST /v1/kv/transfers bodies
    descriptors: list[dict] = field(default_factory=list)  # what it answered them with
    prefills: list[dict] = field(default_factory=list)  # completion bodies with kv_transfer_params
    aborts: list[str] = field(default_factory=list)  # DELETE /v1/kv/transfers/{id}


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
            Route("/v1/kv/transfers", self.transfer, methods=["POST"]),
            Route("/v1/kv/transfers/{transfer_id}", self.abort_transfer, methods=["DELETE"]),
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
        info: dict = {"reservations": True, "model": {"id": MODEL, "vocab_size": 1000}}
        if self.behaviour.kv_role is not None:
            info["kv_role"] = self.behaviour.kv_role
        return self._json(info)

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
            body = {"lease_id": f"{self.port}.lease{self._leases}", "blocks": 2, "pinned_blocks": 0}
            self.seen.leases.append(body["lease_id"])
        return self._json(body, status)

    async def release(self, request: Request) -> Response:
        self.seen.releases.append(request.path_params["lease"])
        return self._json({"released": True})

    async def transfer(self, request: Request) -> Response:
        body = await request.json()
        self.seen.transfers.append(body)
        status, answer = self.behaviour.transfer
        if answer is None:
            blocks = self.behaviour.transfer_blocks
            blocks = len(body["prompt_token_ids"]) // 16 if blocks is None else blocks
            answer = {"descriptor": {"transfer_id": f"{self.port}.t{len(self.seen.transfers)}",
                                     "num_blocks": blocks, "num_bytes": blocks * 4096, "num_tokens": blocks * 16,
                                     "lease_id": body["lease_id"], "layout": {"block_size": 16},
                                     "address": "127.0.0.1:1"}}
            self.seen.descriptors.append(answer["descriptor"])
        return self._json(answer, status)

    async def abort_transfer(self, request: Request) -> Response:
        self.seen.aborts.append(request.path_params["transfer_id"])
        return self._json({"aborted": True})

    async def _prefill(self, body: dict) -> Response:
        self.seen.prefills.append(body)
        await asyncio.sleep(self.behaviour.prefill_delay_s)
        status, answer = self.behaviour.prefill
        if answer is None:
            desc = body["kv_transfer_params"]
            answer = {"id": f"cmpl-prefill-{self.port}", "object": "text_completion", "model": MODEL,
                      "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                                "total_tokens": len(body["prompt"]) + 1},
                      "kv_transfer": {"transfer_id": desc["transfer_id"], "num_bytes": desc["num_bytes"],
                                      "seconds": 0.002, "first_token": 7}}
        return self._json(answer, status)

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        if "kv_transfer_params" in body:
            return await self._prefill(body)
        self.seen.completions += 1
        self.seen.completion_bodies.append(body)
        self.seen.completion_leases.append(request.headers.get("x-reservation-id"))
        status = self.behaviour.completion
        if status != 200:
            return self._json({"error": {"message": "no", "type": "x", "param": None, "code": "fake"}}, status)
        if self.behaviour.stall_body:
            async def never():
                yield b'{"id": "x", '
                await asyncio.sleep(3600)
            return StreamingResponse(never(), media_type="application/json", headers={LOAD_HEADER: LOAD})
        if body.get("stream"):
            return StreamingResponse(self._events(), media_type="text/event-stream", headers={LOAD_HEADER: LOAD})
        return self._json({"id": f"cmpl-{self.port}", "object": "text_completion", "model": MODEL,
                           "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                           "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    async def _events(self):
        head = {"id": f"cmpl-{self.port}", "object": "text_completion", "created": 0, "model": MODEL}
        for event in ({**head, "choices": [{"index": 0, "text": " ok", "token_ids": [7], "finish_reason": None}]},
                      {**head, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                      {**head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                                        "total_tokens": 3}}):
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    def __enter__(self) -> FakeReplica:
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "the fake replica")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.server.force_exit = True
        self.thread.join(10)
