"""One streamed request to an OpenAI-compatible server, with its timestamps.

A chunk counts as a token chunk when it carries generated text; the role-only first chunk
of a chat stream, the finish chunk and the usage chunk do not. TTFT is the first token
chunk; ITL is every gap between consecutive token chunks; E2EL runs to the end of the
stream (`data: [DONE]`). Output tokens come from the final `usage`, not from chunk counts.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from meshserve.bench.datasets import BenchRequest


@dataclass
class RequestRecord:
    success: bool = False
    error: str | None = None  # a short kind, never the prompt or the server's message
    prompt_len: int | None = None  # what the dataset intended
    prompt_tokens: int | None = None  # what the server reported in usage
    output_tokens: int | None = None  # from usage; None when the server sent none
    token_chunks: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    start: float = 0.0  # perf_counter when the request was sent


class OpenAIStreamClient:
    """Sends through `session`, which carries any authorization header."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, endpoint: str, model: str,
                 *, ignore_eos: bool = True, temperature: float = 0.0) -> None:
        self.session = session
        self.url = base_url.rstrip("/") + endpoint
        self.chat = endpoint.endswith("/chat/completions")
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature

    def payload(self, req: BenchRequest) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # vLLM's extension: generate exactly max_tokens
            body["ignore_eos"] = True
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        return body

    def _chunk_text(self, choice: dict) -> str:
        if not self.chat:
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(prompt_len=req.prompt_len)
        rec.start = last = time.perf_counter()
        done = False
        try:
            async with self.session.post(self.url, json=self.payload(req)) as resp:
                if resp.status != 200:
                    rec.error = await _http_error_kind(resp)
                    return rec
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, SSE comments, keep-alives
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        err = chunk["error"] if isinstance(chunk["error"], dict) else {}
                        rec.error = f"stream error ({err.get('code') or err.get('type') or 'unknown'})"
                    if usage := chunk.get("usage"):
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.output_tokens = usage.get("completion_tokens")
                    choices = chunk.get("choices") or []
                    if choices and self._chunk_text(choices[0]):
                        if rec.token_chunks == 0:
                            rec.ttft = now - rec.start
                        else:
                            rec.itl.append(now - last)
                        rec.token_chunks += 1
                        last = now
            rec.e2el = time.perf_counter() - rec.start
            if rec.error is None and not done:
                rec.error = "stream ended without [DONE]"
            elif rec.error is None and rec.token_chunks == 0:
                rec.error = "stream carried no tokens"  # no TTFT to measure
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: bad JSON
            rec.error = type(exc).__name__
        rec.success = rec.error is None
        return rec


async def _http_error_kind(resp: aiohttp.ClientResponse) -> str:
    """'HTTP 429 (rate_limit_exceeded)': status plus the error's code or type. The message
    is left out: servers may quote the request in it."""
    detail = ""
    try:
        body = await resp.json(content_type=None)
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict):
            detail = str(err.get("code") or err.get("type") or "")
    except (aiohttp.ClientError, ValueError):
        pass
    return f"HTTP {resp.status} ({detail})" if detail else f"HTTP {resp.status}"
