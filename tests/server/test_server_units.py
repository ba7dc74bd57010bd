"""Pieces of the server tested without processes: output deltas, the engine loop, settings, errors."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time

import pytest
from server_fake_engine import FakeEngine

from meshserve.api.errors import from_value_error
from meshserve.api.sse import DONE, sse_event
from meshserve.engine.core_proc import EngineLoop
from meshserve.engine.errors import EngineDeadError
from meshserve.engine.messages import AddRequest, Shutdown, StepOutput
from meshserve.engine.output import EngineRequest
from meshserve.sampling_params import SamplingParams
from meshserve.server.server_config import ServerConfig
from meshserve.server.serving import sse_stream


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _request(**params) -> EngineRequest:
    return EngineRequest("r", [ord("p")], SamplingParams(**params), _Tok(), 0.0, seqs=[])


def test_deltas_carry_only_what_is_new_per_sample_and_each_finish_once():
    req = _request(n=2)
    a, b = req.samples
    a.append(ord("a"), None, final=False, check_stops=True)
    b.append(ord("x"), None, final=False, check_stops=True)
    d = req.take_delta()
    assert [(s.index, s.text, s.token_ids) for s in d.outputs] == [(0, "a", [97]), (1, "x", [120])]
    a.append(ord("b"), None, final=False, check_stops=True)  # sample 1 did not move
    assert [(s.index, s.text, s.token_ids) for s in req.take_delta().outputs] == [(0, "b", [98])]
    b.append(ord("y"), None, final=True, check_stops=True)
    b.finish("length")
    d = req.take_delta()
    assert [(s.index, s.text, s.finish_reason) for s in d.outputs] == [(1, "y", "length")] and not d.finished
    # A finished choice is not sent again while its sibling goes on.
    a.append(ord("c"), None, final=False, check_stops=True)
    assert [s.index for s in req.take_delta().outputs] == [0]
    a.append(ord("d"), None, final=True, check_stops=True)
    a.finish("length")
    d = req.take_delta()
    assert [(s.index, s.text, s.finish_reason) for s in d.outputs] == [(0, "d", "length")] and d.finished
    assert req.take_delta() is None


def test_deltas_hold_back_a_possible_stop_string():
    req = _request(stop=["END", "x"])
    (s,) = req.samples
    for ch in "hello E":
        s.append(ord(ch), None, final=False, check_stops=True)
    assert req.take_delta().outputs[0].text == "hello"  # the last len("END") - 1 could start "END"
    s.append(ord("N"), None, final=False, check_stops=True)
    assert req.take_delta().outputs[0].text == " "
    s.append(ord("D"), None, final=False, check_stops=True)  # the stop string is cut, never sent
    d = req.take_delta()
    assert d.outputs[0].text == "" and d.outputs[0].finish_reason == "stop" and d.outputs[0].stop_reason == "END"
    assert d.finished


class _CountingEngine(FakeEngine):
    """Counts the loop's checks for work, and tells when the loop goes idle: it asks for the health
    watch as it starts to block waiting for work, after its last check."""

    def __init__(self):
        super().__init__(step_delay=0.001)
        self.calls = 0
        self.idle = threading.Event()

    def has_unfinished_requests(self) -> bool:
        self.calls += 1
        return super().has_unfinished_requests()

    def health_watch(self):
        self.idle.set()
        return super().health_watch()


def test_engine_loop_blocks_when_idle_and_steps_while_busy():
    in_r, in_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    engine = _CountingEngine()
    loop = threading.Thread(target=EngineLoop(engine, in_r, out_w).run, daemon=True)
    loop.start()
    assert engine.idle.wait(10), "the engine loop never waited for work"
    engine.idle.clear()
    in_w.send([AddRequest("a", [104, 105], SamplingParams(max_tokens=5), time.monotonic())])
    texts = ""
    while True:
        event = out_r.recv()
        if isinstance(event, StepOutput):
            texts += "".join(s.text for d in event.deltas for s in d.outputs)
            if any(d.finished for d in event.deltas):
                break
    assert texts == "hihih"
    # After its last step the loop checks once more and blocks. Wait until it has (a busy machine may
    # run the thread late, and a fixed pause could end before that check), then count over a window.
    assert engine.idle.wait(10), "the engine loop did not go back to waiting for work"
    calls = engine.calls
    time.sleep(0.3)
    assert engine.calls == calls, "the idle engine loop is spinning"
    assert not out_r.poll(0)  # and it has nothing to say: its last stats went out with the last step
    in_w.send([Shutdown()])
    loop.join(5)
    assert not loop.is_alive()


@pytest.mark.parametrize("kwargs,needle", [
    ({"port": 70000}, "--port"), ({"drain_timeout": -1}, "--drain-timeout"),
    ({"max_queued_requests": 0}, "--max-queued-requests"), ({"max_body_bytes": 10}, "--max-body-bytes"),
    ({"data_parallel_size": 0}, "--data-parallel-size"), ({"api_key": " "}, "--api-key"),
])
def test_server_config_names_the_bad_flag(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerConfig(**kwargs)


def test_value_errors_name_their_parameter():
    err = from_value_error(ValueError("max_tokens must be in [1, inf], got 0"))
    assert (err.status, err.param) == (400, "max_tokens")
    assert from_value_error(ValueError("prompt must not be empty")).param == "prompt"
    assert from_value_error(ValueError("the KV cache is full")).param is None


@pytest.mark.parametrize("failure", [EngineDeadError("engine 0 stopped"), RuntimeError("a bug in a view")])
def test_a_stream_that_fails_after_it_started_ends_with_its_error_and_done(failure):
    """Whatever breaks mid-stream (the engine, or the server's own code), the client gets the error
    event and [DONE], never a connection cut in the middle of the body; the outputs are closed."""
    closed = []

    async def chunks():
        yield {"choices": [{"text": "partial"}]}
        raise failure

    async def outputs():
        try:
            yield None
        finally:
            closed.append(True)

    async def collect() -> list[bytes]:
        out = outputs()
        await out.__anext__()
        return [b async for b in sse_stream(chunks(), out, "req-1", lambda: "running=0")]

    events = asyncio.run(collect())
    assert events[0] == sse_event({"choices": [{"text": "partial"}]})
    error = json.loads(events[1][len(b"data: "):])["error"]
    assert error["code"] == "partial_stream_failure" and error["request_id"] == "req-1"
    assert events[-1] == DONE and closed == [True]
