"""POST /v1/chat/completions: messages -> chat template -> one engine request with n samples."""
from __future__ import annotations

import time
import uuid
from collections import defaultdict
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from meshserve.server.engine_core import RequestDelta
from meshserve.server.errors import bad_request
from meshserve.server.protocol import ChatCompletionRequest, ChatMessage
from meshserve.server.serving import (ServingContext, chain, clamp_logprob, parse, read_json, sse_stream,
                                      usage)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(ChatCompletionRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    try:
        text = ctx.tokenizer.apply_chat_template([_message(m) for m in req.messages],
                                                 add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # the template's own checks (roles, order) speak for themselves
        raise bad_request(f"messages: {exc}", param="messages") from None
    # The template already wrote the special tokens it wants (as LLM.chat does).
    ids = await ctx.encode(text, "messages", add_special_tokens=False)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = ctx.max_tokens(requested, len(ids), default=None)  # default: the rest of the context
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, logprobs)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    view = _ChatView(ctx, req, completion_id, len(ids), request.state.request_id)
    return await ctx.respond(request, [(completion_id, ids, params)], arrival, req.stream,
                             view.collect, view.events)


def _message(m: ChatMessage) -> dict:
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        content = "\n".join(part.text for part in m.content)
    # Chat templates know "system"; OpenAI's newer name for it is "developer".
    return {"role": "system" if m.role == "developer" else m.role, "content": content}


class _ChatView:
    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, completion_id: str,
                 prompt_tokens: int, request_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.id = completion_id
        self.prompt_tokens = prompt_tokens
        self.request_id = request_id
        self.created = int(time.time())

    def _logprobs(self, token_ids: list[int], entries) -> dict:
        ctx, num = self.ctx, self.req.top_logprobs or 0
        entries = entries or [{}] * len(token_ids)
        content = []
        for t, e in zip(token_ids, entries):
            s = ctx.token_str(t)
            content.append({"token": s, "logprob": clamp_logprob(e.get(t, -float("inf"))),
                            "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": ts, "logprob": lp, "bytes": list(ts.encode("utf-8"))}
                                             for ts, lp in ctx.top_logprobs(e, num)]})
        return {"content": content}

    def _body(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name,
                "choices": choices}

    async def collect(self, outputs: AsyncIterator[RequestDelta]) -> dict:
        texts: dict[int, list[str]] = defaultdict(list)
        tokens: dict[int, list[int]] = defaultdict(list)
        entries: dict[int, list] = defaultdict(list)
        finish: dict[int, str] = {}
        async for delta in outputs:
            for s in delta.outputs:
                texts[s.index].append(s.text)
                tokens[s.index].extend(s.token_ids)
                entries[s.index].extend(s.logprobs or ())
                if s.finish_reason:
                    finish[s.index] = s.finish_reason
        choices = [{"index": k, "message": {"role": "assistant", "content": "".join(texts[k])},
                    "logprobs": self._logprobs(tokens[k], entries[k]) if self.req.logprobs else None,
                    "finish_reason": finish.get(k)} for k in range(self.req.n)]
        body = self._body("chat.completion", choices)
        body["usage"] = usage(self.prompt_tokens, sum(len(t) for t in tokens.values()))
        return body

    async def _chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncIterator[dict]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage

        def chunk(choices: list[dict]) -> dict:
            body = self._body("chat.completion.chunk", choices)
            if include_usage:
                body["usage"] = None
            return body

        for k in range(self.req.n):
            yield chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        completion_tokens = 0
        async for delta in outputs:
            for s in delta.outputs:
                completion_tokens += len(s.token_ids)
                if not s.text and s.finish_reason is None and not self.req.logprobs:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                yield chunk([{"index": s.index, "delta": {"content": s.text} if s.text else {},
                              "logprobs": self._logprobs(s.token_ids, s.logprobs) if self.req.logprobs else None,
                              "finish_reason": s.finish_reason}])
        if include_usage:
            body = self._body("chat.completion.chunk", [])
            body["usage"] = usage(self.prompt_tokens, completion_tokens)
            yield body

    def events(self, first: RequestDelta, outputs: AsyncIterator[RequestDelta]) -> AsyncIterator[bytes]:
        return sse_stream(self._chunks(chain(first, outputs)), outputs, self.request_id)
