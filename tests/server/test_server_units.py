"""Pieces of the server tested without processes: output deltas, the engine loop, settings, errors."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
from server_fake_engine import FakeEngine

from meshserve.api.errors import from_value_error
from meshserve.engine.messages import AddRequest
from meshserve.outputs import CompletionOutput, RequestOutput
from meshserve.sampling_params import SamplingParams
from meshserve.server.engine_core import DeltaTracker, EngineLoop
from meshserve.server.server_config import ServerConfig


def _out(texts: list[str], tokens: list[list[int]], finish=None) -> RequestOutput:
    outs = [CompletionOutput(i, t, ids, finish) for i, (t, ids) in enumerate(zip(texts, tokens))]
    return RequestOutput("r", None, [1], outs, finish is not None)


def test_delta_tracker_sends_only_what_is_new_per_sample():
    tracker = DeltaTracker()
    tracker.track("r", SamplingParams(n=2))
    d = tracker.delta(_out(["a", "x"], [[1], [9]]))
    assert [(s.index, s.text, s.token_ids) for s in d.outputs] == [(0, "a", [1]), (1, "x", [9])]
    d = tracker.delta(_out(["ab", "x"], [[1, 2], [9]]))  # sample 1 did not move
    assert [(s.index, s.text, s.token_ids) for s in d.outputs] == [(0, "b", [2])]
    d = tracker.delta(_out(["abc", "xy"], [[1, 2, 3], [9, 8]], finish="length"))
    assert [(s.text, s.finish_reason) for s in d.outputs] == [("c", "length"), ("y", "length")] and d.finished


def test_delta_tracker_holds_back_a_possible_stop_string():
    tracker = DeltaTracker()
    tracker.track("r", SamplingParams(stop=["END", "x"]))
    # the last len("END") - 1 characters could start "END"
    assert tracker.delta(_out(["hello E"], [[1, 2]])).outputs[0].text == "hello"
    assert tracker.delta(_out(["hello EN"], [[1, 2, 3]])).outputs[0].text == " "
    # the engine found the stop string and cut it: nothing that was sent needs taking back
    d = tracker.delta(_out(["hello "], [[1, 2, 3, 4]], finish="stop"))
    assert d.outputs[0].text == "" and d.outputs[0].finish_reason == "stop" and d.finished


class _CountingEngine(FakeEngine):
    def __init__(self):
        super().__init__(step_delay=0.001)
        self.calls = 0

    def has_unfinished_requests(self) -> bool:
        self.calls += 1
        return super().has_unfinished_requests()


def test_engine_loop_blocks_when_idle_and_steps_while_busy():
    in_r, in_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    engine = _CountingEngine()
    loop = threading.Thread(target=EngineLoop(engine, in_r, out_w).run, daemon=True)
    loop.start()
    in_w.send([("add", AddRequest("a", [104, 105], SamplingParams(max_tokens=5), time.monotonic()))])
    texts = ""
    while True:
        msg = out_r.recv()
        if msg[0] == "step":
            texts += "".join(s.text for d in msg[2] for s in d.outputs)
            if any(d.finished for d in msg[2]):
                break
    assert texts == "hihih"
    time.sleep(0.1)
    calls = engine.calls
    time.sleep(0.3)
    assert engine.calls == calls, "the idle engine loop is spinning"
    assert not out_r.poll(0)  # and it has nothing to say: its last stats went out with the last step
    in_w.send([("shutdown",)])
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
