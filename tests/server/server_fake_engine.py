"""A stand-in for LLMEngine with the same interface, fast and deterministic, to test the HTTP front end.

It is an "echo model": sample i's j-th token is prompt[(i + j) % len(prompt)], one token per step
per sequence. Tokens are UTF-8 bytes (vocabulary 256). A prompt containing CRASH makes the engine
fail after its second token, which kills the engine process like a real fault would; one containing
WEDGE makes its step hang forever (an engine that never reads its pipe again).

Controls for tests that must not depend on how fast the machine is: while the --pause-file exists,
a running request gets its first token and then no more (it holds its seat for as long as the test
needs, where a stream of N tokens would end after N step delays, sooner than a busy machine's test
may get its checks done); while the --restart-gate exists, a restarted engine does not finish
loading (the window in which the server runs without it lasts until the test closes it).

Run a server over it:  PYTHONPATH=tests/server python -c "import server_fake_engine as f; f.main()" --port P
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

from meshserve.engine.messages import (
    EngineStats,
    LeaseInfo,
    LeaseLedger,
    LeaseRef,
    ModelInfo,
    RequestDelta,
    ReserveRequest,
)
from meshserve.engine.output import EngineRequest
from meshserve.engine.protocol import UnsupportedCall

BLOCK = 16
NUM_BLOCKS = 64


class FakeTokenizer:
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="ignore")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        if messages[-1]["role"] == "assistant" and add_generation_prompt:
            raise ValueError("the last message must not be the assistant's")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Implements engine/protocol.py's EngineProtocol (without reservations)."""

    def __init__(self, step_delay: float = 0.002, max_num_seqs: int = 8, max_model_len: int = 128,
                 restart_delay: float = 0.0, started_marker: str | None = None,
                 pause_file: str | None = None, restart_gate: str | None = None):
        if started_marker is not None:  # a restart (the marker exists) takes restart_delay to load,
            if os.path.exists(started_marker):  # and waits while the restart gate exists
                time.sleep(restart_delay)
                while restart_gate is not None and os.path.exists(restart_gate):
                    time.sleep(0.01)
            open(started_marker, "a").close()
        self.pause_file = pause_file
        self.tokenizer = FakeTokenizer()
        self.model_info = ModelInfo("fake-echo", max_model_len, "0123456789abcdef", 256)
        self.step_delay = step_delay
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def config_dict(self) -> dict:
        return {"model": "fake-echo", "block_size": BLOCK}

    def add_request(self, request_id, prompt, params, arrival_time=None, lease_id=None, lease_owner="",
                    cache_salt="", kv_transfer=None) -> list[int]:
        if kv_transfer is not None:
            raise ValueError("this engine sends no KV")
        if lease_id is not None:
            raise ValueError("this engine grants no reservations")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, max_model_len is {self.max_model_len}")
        self.waiting.append(EngineRequest(request_id, ids, params, self.tokenizer,
                                         arrival_time or time.monotonic(), seqs=[]))
        return ids

    def abort_request(self, request_id):
        self.waiting = [r for r in self.waiting if r.request_id != request_id]
        self.running = [r for r in self.running if r.request_id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestDelta]:
        time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop(0)
            self.prompt_tokens += len(req.prompt_ids)
            self.running.append(req)
        deltas = []
        held = self.pause_file is not None and os.path.exists(self.pause_file)
        for req in self.running:
            if held and all(sample.token_ids for sample in req.samples):
                continue  # paused: it has its first token, and gets no more for now
            for sample in req.samples:
                if not sample.finished:
                    self._advance(req, sample)
            if b"CRASH" in bytes(req.prompt_ids) and len(req.samples[0].token_ids) > 2:
                raise RuntimeError("simulated engine failure")
            if b"WEDGE" in bytes(req.prompt_ids):
                time.sleep(3600)
            deltas.append(req.take_delta())
        self.running = [r for r in self.running if not r.finished]
        return deltas

    def _advance(self, req: EngineRequest, sample) -> None:
        p = req.params
        token = req.prompt_ids[(sample.index + len(sample.token_ids)) % len(req.prompt_ids)]
        self.generation_tokens += 1
        lp = (-0.25, [((token + k) % 256, -0.25 - k) for k in range(1, p.logprobs + 1)]) if p.logprobs else None
        if p.logprobs == 0:
            lp = (-0.25, [])
        final = len(sample.token_ids) + 1 >= p.max_tokens
        sample.append(token, lp, final=final, check_stops=True)
        if final:
            sample.finish("length")

    def get_stats(self) -> EngineStats:
        blocks = sum(-(-(len(r.prompt_ids) + max(len(s.token_ids) for s in r.samples)) // BLOCK) * len(r.samples)
                     for r in self.running)
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           kv_cache_usage=min(1.0, blocks / NUM_BLOCKS), num_prompt_tokens=self.prompt_tokens,
                           num_generation_tokens=self.generation_tokens, block_size=BLOCK)

    def reserve(self, req: ReserveRequest) -> LeaseInfo | None:
        raise UnsupportedCall

    def release_lease(self, ref: LeaseRef) -> bool:
        raise UnsupportedCall

    def leases(self, owner: str = "") -> LeaseLedger:
        raise UnsupportedCall

    def kv_prepare(self, req):
        raise UnsupportedCall

    def kv_abort(self, transfer_id: str) -> bool:
        return False

    def check_health(self) -> None:
        pass

    def health_watch(self) -> tuple[list, float | None]:
        return [], None

    def record_ipc(self, seconds: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


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
    p.add_argument("--max-prompts-per-request", type=int, default=64)
    p.add_argument("--max-engine-restarts", type=int, default=5)
    p.add_argument("--restart-delay", type=float, default=0.0, help="seconds a restarted engine takes to load")
    p.add_argument("--max-stream-backlog", type=int, default=1024)
    p.add_argument("--pause-file", default=None, help="while it exists, no request gets a token past its first")
    p.add_argument("--restart-gate", default=None, help="while it exists, a restarted engine does not finish loading")
    p.add_argument("--health-timeout", type=float, default=5.0)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    config = ServerConfig(port=a.port, api_key=a.api_key, drain_timeout=a.drain_timeout,
                          max_queued_requests=a.max_queued_requests, max_body_bytes=a.max_body_bytes,
                          data_parallel_size=a.data_parallel_size, log_level="warning",
                          max_prompts_per_request=a.max_prompts_per_request,
                          max_engine_restarts=a.max_engine_restarts, max_stream_backlog=a.max_stream_backlog,
                          health_timeout=a.health_timeout)
    markers = tempfile.mkdtemp(prefix="meshserve-fake-")
    factories = [functools.partial(FakeEngine, step_delay=a.step_delay, max_num_seqs=a.max_num_seqs,
                                   max_model_len=a.max_model_len, restart_delay=a.restart_delay,
                                   started_marker=os.path.join(markers, str(rank)), pause_file=a.pause_file,
                                   restart_gate=a.restart_gate)
                 for rank in range(a.data_parallel_size)]
    return run_server({"model": "fake-echo"}, config, factories=factories)
