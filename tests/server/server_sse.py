"""Reading server-sent events in tests."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import httpx


def next_event(lines: Iterator[str]) -> dict:
    """The next `data:` event. Keep `lines` referenced: dropping the iterator closes the stream."""
    return json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])


def read_events(source: httpx.Response | Iterable[str]) -> list[dict]:
    """Every (remaining) `data:` event of a stream; asserts that `[DONE]` comes last and only once.
    Comment lines (the server's `: load ...` report) are legal SSE and skipped."""
    lines = source.iter_lines() if isinstance(source, httpx.Response) else source
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            assert line == "" or line.startswith(": "), f"unexpected SSE line {line!r}"
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
