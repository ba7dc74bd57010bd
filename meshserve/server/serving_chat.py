"""POST /v1/chat/completions: messages (and tools) -> chat template -> one engine request with n
samples -> each choice's content and tool calls (server/tools.py, server/tool_parsers.py)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.chunks import (
    CHAT_CHUNK_OBJECT,
    CHAT_OBJECT,
    chat_delta_choice,
    chat_message_choice,
    tool_call,
    usage,
)
from meshserve.api.errors import bad_request
from meshserve.api.json_body import parse, read_json
from meshserve.api.protocol import ChatCompletionRequest
from meshserve.engine.messages import RequestDelta
from meshserve.server.serving import ResponseView, ServingContext, clamp_logprob
from meshserve.server.tool_parsers import ParsedCall, ToolParser, parse_tool_calls
from meshserve.server.tools import ToolPlan, plan_tools


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
    plan = plan_tools(req, ctx.config.tool_call_parser)
    ids = await ctx.render_chat(req.messages, req.add_generation_prompt, plan.tools)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = ctx.max_tokens(requested, len(ids), default=None)  # default: the rest of the context
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, logprobs, plan.constraint)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    view = _ChatView(ctx, req, completion_id, request.state.request_id, len(ids), plan)
    return await ctx.respond(request, [(completion_id, ids, params)], arrival, view)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(reason: str | None, parser: ToolParser | None) -> str | None:
    """A complete answer that called a tool ends with "tool_calls" (a cut-off one stays "length")."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.num_calls else reason


class _ChatView(ResponseView[ChatCompletionRequest]):
    object_name = CHAT_OBJECT
    chunk_object_name = CHAT_CHUNK_OBJECT

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, response_id: str, request_id: str,
                 prompt_tokens: int, plan: ToolPlan) -> None:
        super().__init__(ctx, req, response_id, request_id, prompt_tokens)
        self.plan = plan

    def _message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None, ToolParser | None]:
        """A whole choice's content (None when it is only calls) and tool calls (None: the
        request has no tools, and the message no tool_calls field)."""
        parser = self.plan.parser()
        if parser is None:
            return text, [] if self.req.tools else None, None
        content, calls = parse_tool_calls(parser, text)
        calls = self._allowed(calls, 0)
        return (content if content.strip() or not calls else None), _calls(calls), parser

    def _allowed(self, calls: list[ParsedCall], made: int) -> list[ParsedCall]:
        """Of the calls found after `made` others, those the answer may make."""
        limit = self.plan.max_calls
        return calls if limit is None else calls[:max(0, limit - made)]

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
        choices = []
        for k in range(self.req.n):
            c = gathered[k]
            content, calls, parser = self._message(c.text)
            logprobs = self._logprobs(c.token_ids, c.logprobs) if self.req.logprobs else None
            choices.append(chat_message_choice(k, content, logprobs, _finish_reason(c.finish_reason, parser), calls))
        return {**self.body(choices), "usage": usage(self.prompt_tokens, completion_tokens)}

    async def chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncGenerator[dict, None]:
        for k in range(self.req.n):
            yield self.body([chat_delta_choice(k, "", role="assistant")], chunk=True)
        completion_tokens = 0
        parsers = [self.plan.parser() for _ in range(self.req.n)]  # each choice reads its own calls
        num_calls = [0] * self.req.n
        async for delta in outputs:
            for s in delta.outputs:
                completion_tokens += len(s.token_ids)
                text, parser = s.text, parsers[s.index]
                found: list[ParsedCall] = []
                if parser is not None:  # text that may become a call is held back until it is known
                    text, found = parser.feed(s.text)
                    if s.finish_reason is not None:
                        rest, more = parser.finish()
                        text, found = text + rest, found + more
                calls = _calls(self._allowed(found, num_calls[s.index]), num_calls[s.index])
                num_calls[s.index] += len(calls)
                finish = _finish_reason(s.finish_reason, parser)
                if not text and not calls and finish is None and not self.req.logprobs and not self.return_token_ids:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                logprobs = self._logprobs(s.token_ids, s.logprobs) if self.req.logprobs else None
                yield self.body([chat_delta_choice(s.index, text, logprobs, finish,
                                                   s.token_ids if self.return_token_ids else None,
                                                   tool_calls=calls)], chunk=True)
        if self.include_usage:
            yield self.usage_chunk(completion_tokens)


def _calls(parsed: list[ParsedCall], first_index: int | None = None) -> list[dict[str, Any]]:
    """The answer's calls with fresh ids (`first_index`: a stream's, numbered from there)."""
    return [tool_call(_call_id(), c.name, c.arguments, None if first_index is None else first_index + i)
            for i, c in enumerate(parsed)]
