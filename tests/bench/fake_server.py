"""A small OpenAI-compatible server for benchmark tests: deterministic tokenizer and delays.

Run as a script (prints `READY http://127.0.0.1:PORT` once it listens):
    python tests/bench/fake_server.py [MODEL] --port 0 --ttft-ms 40 --itl-ms 10

Timing: the first token goes out `ttft_ms / tp` after the request starts, then one token
per chunk every `itl_ms / tp`; a larger --tensor-parallel-size is a faster server, which
gives the scaling benchmark something to measure. `--max-num-seqs N` serves N requests at
a time and queues the rest. Failures on purpose: `--reject-every N` answers every Nth
accepted request with 429; prompts that do not fit --max-model-len get 400;
`--partial-fail-every N` breaks every Nth stream halfway with a partial_stream_failure
event; `--api-key K` answers 401 without `Authorization: Bearer K`; `--startup-delay S`
listens only after S seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

BOS = "<s>"
_CORPUS = (
    "the quick brown fox jumps over the lazy dog while a small bird sings in the old tree "
    "people often think that time goes faster when they work on something they like and "
    "every state has a government that makes the law for the world and its children"
)


def _build_vocab() -> list[str]:
    pieces = {chr(c) for c in range(32, 127)} | {"\n"}
    for n in (2, 3, 4):  # n-grams that cross word boundaries: re-encoding merges pieces
        pieces |= {_CORPUS[i:i + n] for i in range(len(_CORPUS) - n + 1)}
    return [BOS] + sorted(pieces)


class ToyTokenizer:
    """Greedy longest match over a fixed vocabulary, with a BOS token in front. Decoding
    random ids and encoding the text again does not give the same count, like real BPE."""

    def __init__(self) -> None:
        self.vocab = _build_vocab()
        self.ids = {p: i for i, p in enumerate(self.vocab) if p != BOS}
        self.longest = max(len(p) for p in self.ids)

    def encode(self, text: str) -> list[int]:
        out, i = [0], 0
        while i < len(text):
            for n in range(min(self.longest, len(text) - i), 0, -1):
                tid = self.ids.get(text[i:i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:  # a character outside the vocabulary: skip it, as an <unk> would
                i += 1
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if 0 < i < len(self.vocab))


@dataclass
class FakeConfig:
    model: str = "fake-model"
    max_model_len: int = 4096
    ttft_ms: float = 40.0
    itl_ms: float = 10.0
    reject_every: int = 0
    partial_fail_every: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int = 0  # >0: requests beyond this many wait their turn, like a full batch
    api_key: str | None = None  # every endpoint but /health then needs "Bearer <key>"


def _error(status: int, message: str, etype: str, code: str, **headers: str) -> web.Response:
    body = {"error": {"message": message, "type": etype, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


class _SSE:
    """Server-sent events in OpenAI's chunk shapes."""

    def __init__(self, resp: web.StreamResponse, chat: bool, base: dict) -> None:
        self.resp, self.chat, self.base = resp, chat, base

    async def event(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        await self.resp.write(f"data: {text}\n\n".encode())

    async def chunk(self, choices: list, **extra) -> None:
        await self.event({**self.base, "choices": choices, **extra})

    async def token(self, text: str, finish: str | None = None) -> None:
        choice = {"index": 0, "delta": {"content": text} if text else {}} if self.chat else {"index": 0, "text": text}
        await self.chunk([{**choice, "finish_reason": finish}])


class FakeServer:
    def __init__(self, cfg: FakeConfig) -> None:
        self.cfg = cfg
        self.tok = ToyTokenizer()
        self.accepted = itertools.count(1)
        self.output_ids = [i for i, p in enumerate(self.tok.vocab) if len(p) == 3 and p.isalpha()]
        self.slots = asyncio.Semaphore(cfg.max_num_seqs) if cfg.max_num_seqs else None

    @web.middleware
    async def auth(self, request: web.Request, handler):
        if (self.cfg.api_key and request.path != "/health"
                and request.headers.get("Authorization") != f"Bearer {self.cfg.api_key}"):
            return _error(401, "missing or wrong API key", "authentication_error", "invalid_api_key")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        revision = hashlib.sha256(self.cfg.model.encode()).hexdigest()[:16]
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": 0, "owned_by": "fake",
            "max_model_len": self.cfg.max_model_len, "revision": revision}]})

    async def server_info(self, request: web.Request) -> web.Response:
        # Like a careless server: the key is in there, and the benchmark must not keep it.
        return web.json_response({"model": self.cfg.model, "config": vars(self.cfg)})

    async def tokenize(self, request: web.Request) -> web.Response:
        ids = self.tok.encode((await request.json())["prompt"])
        return web.json_response({"tokens": ids, "count": len(ids),
                                  "max_model_len": self.cfg.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": self.tok.decode((await request.json())["tokens"])})

    def _prompt_tokens(self, body: dict, chat: bool) -> int:
        if chat:
            text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in body["messages"])
            return len(self.tok.encode(text + "<|assistant|>\n"))
        return len(self.tok.encode(body["prompt"]))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        body = await request.json()
        rid = request.headers.get("X-Request-Id", uuid.uuid4().hex)
        n_prompt = self._prompt_tokens(body, chat)
        max_tokens = int(body.get("max_tokens", 16))
        if n_prompt + max_tokens > self.cfg.max_model_len:
            return _error(400, f"prompt of {n_prompt} tokens plus {max_tokens} output tokens "
                          f"exceeds {self.cfg.max_model_len}", "invalid_request_error",
                          "context_length_exceeded")
        index = next(self.accepted)
        if self.cfg.reject_every and index % self.cfg.reject_every == 0:
            return _error(429, "queue full", "rate_limit_error", "rate_limit_exceeded",
                          **{"Retry-After": "1"})
        fail_at = max_tokens // 2 if (self.cfg.partial_fail_every
                                     and index % self.cfg.partial_fail_every == 0) else None
        if not body.get("stream"):
            return _error(400, "this test server only streams", "invalid_request_error",
                          "stream_required")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Request-Id": rid})
        await resp.prepare(request)
        sse = _SSE(resp, chat, {"id": rid, "created": int(time.time()), "model": self.cfg.model,
                                "object": "chat.completion.chunk" if chat else "text_completion"})
        if chat:  # like vLLM: a role-only chunk at once, before any token exists
            await sse.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None}])
        async with self.slots or contextlib.nullcontext():
            finished = await self._generate(sse, max_tokens, fail_at, rid)
        if finished and (body.get("stream_options") or {}).get("include_usage"):
            await sse.chunk([], usage=self._usage(n_prompt, max_tokens))
        await sse.event("[DONE]")
        await resp.write_eof()
        return resp

    async def _generate(self, sse: _SSE, max_tokens: int, fail_at: int | None,
                        rid: str) -> bool:
        """Token chunks on schedule; False when the stream was broken on purpose."""
        start = time.perf_counter()
        for i, tid in enumerate(self._output(max_tokens)):
            if i == fail_at:
                await sse.event({"error": {"code": "partial_stream_failure", "request_id": rid}})
                return False
            due = start + (self.cfg.ttft_ms + i * self.cfg.itl_ms) / 1000 / self._speedup()
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            await sse.token(self.tok.vocab[tid])
        await sse.token("", finish="length")
        return True

    def _speedup(self) -> float:
        return float(self.cfg.tensor_parallel_size)

    def _output(self, n: int) -> list[int]:
        return [self.output_ids[i % len(self.output_ids)] for i in range(n)]

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


async def serve(cfg: FakeConfig, host: str, port: int, startup_delay: float) -> None:
    await asyncio.sleep(startup_delay)
    runner = web.AppRunner(FakeServer(cfg).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"READY http://{host}:{bound}", flush=True)
    await asyncio.Event().wait()  # until the process is terminated


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="fake-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--ttft-ms", type=float, default=40.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--reject-every", type=int, default=0)
    p.add_argument("--partial-fail-every", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="requests served at once; the rest queue (0: unlimited)")
    p.add_argument("--startup-delay", type=float, default=0.0,
                   help="seconds to wait before listening (tests the health wait)")
    a = p.parse_args()
    cfg = FakeConfig(model=a.model or "fake-model", max_model_len=a.max_model_len,
                     ttft_ms=a.ttft_ms, itl_ms=a.itl_ms, reject_every=a.reject_every,
                     partial_fail_every=a.partial_fail_every,
                     tensor_parallel_size=a.tensor_parallel_size,
                     pipeline_parallel_size=a.pipeline_parallel_size,
                     data_parallel_size=a.data_parallel_size, max_num_seqs=a.max_num_seqs,
                     api_key=a.api_key)
    asyncio.run(serve(cfg, a.host, a.port, a.startup_delay))


if __name__ == "__main__":
    main()
