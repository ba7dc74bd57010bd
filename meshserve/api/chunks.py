"""The shapes of OpenAI completion bodies and stream chunks, built in one place for the server and
the gateway (which re-dresses a resumed stream's chunks as the client's)."""
from __future__ import annotations

from typing import Any

COMPLETION_OBJECT = "text_completion"  # a completion and its chunks
CHAT_OBJECT = "chat.completion"
CHAT_CHUNK_OBJECT = "chat.completion.chunk"


def response_body(response_id: str, object_name: str, created: int, model: str,
                  choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": response_id, "object": object_name, "created": created, "model": model, "choices": choices}


def completion_choice(index: int, text: str, logprobs: Any = None, finish_reason: str | None = None,
                      token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta_choice(index: int, content: str | None, logprobs: Any = None, finish_reason: str | None = None,
                      token_ids: list[int] | None = None, role: str | None = None) -> dict[str, Any]:
    """A streamed chat choice; an empty `content` is left out of the delta unless `role` opens it."""
    delta: dict[str, Any] = {"role": role} if role else {}
    if content or role:
        delta["content"] = content or ""
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_message_choice(index: int, content: str, logprobs: Any = None,
                        finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
