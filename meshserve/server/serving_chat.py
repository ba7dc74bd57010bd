"""POST /v1/chat/completions: messages -> chat template -> one engine request with n samples."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.chunks import CHAT_CHUNK_OBJECT, CHAT_OBJECT, chat_delta_choice, chat_message_choice, usage
from meshserve.api.errors import bad_request
from meshserve.api.json_body import parse, read_json
from meshserve.api.protocol import ChatCompletionRequest
from meshserve.engine.messages import RequestDelta
from meshserve.server.serving import ResponseView, ServingContext, clamp_logprob


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
    ids = await ctx.render_chat(req.messages, req.add_generation_prompt)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = ctx.max_tokens(requested, len(ids), default=None)  # default: the rest of the context
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, logprobs)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    view = _ChatView(ctx, req, completion_id, request.state.request_id, len(ids))
    return await ctx.respond(request, [(completion_id, ids, params)], arrival, view)


class _ChatView(ResponseView[ChatCompletionRequest]):
    object_name = CHAT_OBJECT
    chunk_object_name = CHAT_CHUNK_OBJECT

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict[str, Any]:
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

    async def collect(self, outputs: AsyncIterator[RequestDelta]) -> dict:
        gathered, completion_tokens = await self.gather(outputs)
        choices = [chat_message_choice(k, gathered[k].text,
                                       self._logprobs(gathered[k].token_ids, gathered[k].logprobs)
                                       if self.req.logprobs else None, gathered[k].finish_reason)
                   for k in range(self.req.n)]
        return {**self.body(choices), "usage": usage(self.prompt_tokens, completion_tokens)}

    async def chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncGenerator[dict, None]:
        for k in range(self.req.n):
            yield self.body([chat_delta_choice(k, "", role="assistant")], chunk=True)
        completion_tokens = 0
        async for delta in outputs:
            for s in delta.outputs:
                completion_tokens += len(s.token_ids)
                if not s.text and s.finish_reason is None and not self.req.logprobs and not self.return_token_ids:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                logprobs = self._logprobs(s.token_ids, s.logprobs) if self.req.logprobs else None
                yield self.body([chat_delta_choice(s.index, s.text, logprobs, s.finish_reason,
                                                   s.token_ids if self.return_token_ids else None)], chunk=True)
        if self.include_usage:
            yield self.usage_chunk(completion_tokens)
