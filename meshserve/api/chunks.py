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
                      token_ids: list[int] | None = None, role: str | None = None,
                      tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A streamed chat choice; an empty `content` is left out of the delta unless `role` opens it.
    `tool_calls`: tool_call(...) dicts with their `index` among the choice's calls."""
    delta: dict[str, Any] = {"role": role} if role else {}
    if content or role:
        delta["content"] = content or ""
    if tool_calls:
        delta["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_message_choice(index: int, content: str | None, logprobs: Any = None, finish_reason: str | None = None,
                        tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`tool_calls` None: the key is left out (a request without tools); a list, even empty, is sent."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call(call_id: str, name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One function call of an answer (`index` in a stream's delta); `arguments` is JSON text."""
    call: dict[str, Any] = {"index": index} if index is not None else {}
    call.update({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return call


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
