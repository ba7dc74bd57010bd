"""Reading server-sent events in tests."""
from __future__ import annotations

import json

import httpx


def read_events(response: httpx.Response) -> list[dict]:
    """Every `data:` event of a finished stream; asserts that `[DONE]` comes last and only once."""
    events, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        assert not done, "event after [DONE]"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    assert done, "stream did not end with [DONE]"
    return events


def completion_text(events: list[dict], index: int = 0) -> str:
    return "".join(c["text"] for e in events for c in e.get("choices", []) if c["index"] == index)


def chat_text(events: list[dict], index: int = 0) -> str:
    return "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", [])
                   if c["index"] == index)


def metric(text: str, name: str) -> float:
    """The value of one sample line of a Prometheus exposition (`name` includes labels)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
