"""A stand-in for LLMEngine with the same interface, fast and deterministic, to test the HTTP front end.

It is an "echo model": sample i's j-th token is prompt[(i + j) % len(prompt)], one token per step
per sequence. Tokens are UTF-8 bytes (vocabulary 256). A prompt containing CRASH makes the engine
fail after its second token, which kills the engine process like a real fault would.

Run a server over it:  PYTHONPATH=tests/server python -c "import server_fake_engine as f; f.main()" --port P
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, field

from meshserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

BLOCK = 16
NUM_BLOCKS = 64


class FakeTokenizer:
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="ignore")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ValueError("the last message must not be the assistant's")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    request_id: str
    prompt: list[int]
    params: object
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class FakeEngine:
    def __init__(self, step_delay: float = 0.002, max_num_seqs: int = 8, max_model_len: int = 128):
        self.tokenizer = FakeTokenizer()
        self.model_info = {"id": "fake-echo", "max_model_len": max_model_len, "revision": "0123456789abcdef"}
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, max_model_len is {self.max_model_len}")
        req = _Req(request_id, ids, params, RequestMetrics(arrival_time or time.monotonic()))
        req.outputs = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                       for i in range(params.n)]
        self.waiting.append(req)

    def abort_request(self, request_id):
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running = [r for r in self.running if r.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            self.prompt_tokens += len(req.prompt)
            self.running.append(req)
        outputs = []
        for req in self.running:
            for o in req.outputs:
                if o.finish_reason is None:
                    self._advance(req, o)
            if b"CRASH" in bytes(req.prompt) and len(req.outputs[0].token_ids) > 2:
                raise RuntimeError("simulated engine failure")
            outputs.append(RequestOutput(req.request_id, None, req.prompt, [_copy(o) for o in req.outputs],
                                         req.finished, req.metrics))
        self.running = [r for r in self.running if not r.finished]
        return outputs

    def _advance(self, req: _Req, o: CompletionOutput) -> None:
        p = req.params
        token = req.prompt[(o.index + len(o.token_ids)) % len(req.prompt)]
        o.token_ids.append(token)
        self.generation_tokens += 1
        if o.logprobs is not None:
            o.logprobs.append({(token + k) % 256: -0.25 - k for k in range(p.logprobs + 1)})
        o.text = self.tokenizer.decode(o.token_ids)
        for s in p.stop:
            i = o.text.find(s)
            if i >= 0:
                o.text, o.finish_reason, o.stop_reason = o.text[:i], "stop", s
                return
        if len(o.token_ids) >= p.max_tokens:
            o.finish_reason = "length"

    def get_stats(self) -> dict:
        blocks = sum(-(-(len(r.prompt) + max(len(o.token_ids) for o in r.outputs)) // BLOCK) * len(r.outputs)
                     for r in self.running)
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": min(1.0, blocks / NUM_BLOCKS), "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_prompt_tokens": self.prompt_tokens,
                "num_generation_tokens": self.generation_tokens}


def _copy(o: CompletionOutput) -> CompletionOutput:
    """A snapshot, as the real engine returns: later steps must not change what was handed out."""
    return CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                            list(o.logprobs) if o.logprobs is not None else None)


def main(argv: list[str] | None = None) -> int:
    from meshserve.server.launcher import run_server
    from meshserve.server.server_config import ServerConfig

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024)
    p.add_argument("--step-delay", type=float, default=0.002)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--data-parallel-size", type=int, default=1)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    config = ServerConfig(port=a.port, api_key=a.api_key, drain_timeout=a.drain_timeout,
                          max_queued_requests=a.max_queued_requests, max_body_bytes=a.max_body_bytes,
                          data_parallel_size=a.data_parallel_size, log_level="warning")
    factory = functools.partial(FakeEngine, step_delay=a.step_delay, max_num_seqs=a.max_num_seqs,
                                max_model_len=a.max_model_len)
    return run_server({"model": "fake-echo"}, config, factories=[factory] * a.data_parallel_size)
