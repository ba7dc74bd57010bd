"""How replica events become the client's stream, across attempts and resumed continuations."""
from __future__ import annotations

import copy

from meshserve.api import chunks
from meshserve.gateway.request import GatewayRequest
from meshserve.gateway.upstream import Attempt


class StreamShaper:
    """Turns replica events into the client's stream: strips what the gateway asked for itself
    (token ids, usage the client did not request), keeps one id/model across attempts, turns a
    continuation's completion chunks into chat chunks, and counts what was sent: the token ids the
    gateway asks every replica for say how many tokens were generated as they stream, so a client
    that leaves before the usage chunk is still charged for what it got."""

    def __init__(self, greq: GatewayRequest, replica_index: int) -> None:
        self.greq = greq
        self.head: dict | None = None  # id, object, created, model of the client's stream
        self.sent_ids: list[int] = []
        self.text = ""
        self.completion_tokens = 0  # from the usage chunks
        self.streamed_tokens = 0  # from the token ids, as they come
        self.resumes = 0
        self.finished = False
        self.replica_index = replica_index  # of the attempt being relayed
        self._base_completion = 0  # tokens sent before the current attempt

    def resumed_on(self, attempt: Attempt) -> None:
        self.resumes += 1
        self.replica_index = attempt.replica.index
        self._base_completion = len(self.sent_ids)

    def shape(self, event: dict) -> list[dict]:
        greq = self.greq
        if self.head is None:
            self.head = {k: event[k] for k in ("id", "object", "created", "model") if k in event}
        if self.resumes:
            event = self._as_original(event)
        usage = event.get("usage")
        if usage:
            self.completion_tokens = self._base_completion + int(usage.get("completion_tokens", 0))
            if self.resumes:
                usage = event["usage"] = chunks.usage(greq.prompt_tokens, self.completion_tokens)
        shown = []
        for choice in event.get("choices") or ():
            ids = choice.pop("token_ids", None)
            if ids:
                self.sent_ids.extend(ids)
                self.streamed_tokens += len(ids)
            self.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                self.finished = True
                if self.resumes:
                    event["resumed"] = {"after_tokens": self._base_completion, "attempts": greq.attempts}
            if not ids or _shows_something(choice):  # a chunk sent only for its ids stays here
                shown.append(choice)
        greq.completion_tokens = max(self.completion_tokens, self.streamed_tokens)
        if "choices" in event:
            if event["choices"] and not shown and not usage:
                return []
            event["choices"] = shown
        if not greq.include_usage:
            event.pop("usage", None)
            if usage and not event.get("choices"):
                return []  # the usage chunk the gateway asked for on its own
        return [event]

    def _as_original(self, event: dict) -> dict:
        """A continuation's completion chunk, dressed as the client's stream."""
        event = {**copy.deepcopy(event), **(self.head or {})}
        if self.greq.chat:
            event["choices"] = [chunks.chat_delta_choice(c.get("index", 0), c.get("text"), None,
                                                         c.get("finish_reason"), c.get("token_ids"))
                                for c in event.get("choices") or ()]
        return event

    def text_chunk(self, text: str) -> dict:
        self.text += text
        choice = chunks.chat_delta_choice(0, text) if self.greq.chat else chunks.completion_choice(0, text)
        return {**(self.head or {}), "choices": [choice]}


def _shows_something(choice: dict) -> bool:
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("role") or choice.get("finish_reason")
                or choice.get("logprobs"))
