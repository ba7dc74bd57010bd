"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index."""
from __future__ import annotations

import time
import uuid
from collections import defaultdict
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from meshserve.server.engine_core import RequestDelta
from meshserve.server.errors import bad_request
from meshserve.server.protocol import CompletionRequest
from meshserve.server.serving import (ServingContext, chain, clamp_logprob, parse, read_json, sse_stream,
                                      usage)

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    arrival = time.monotonic()
    req = parse(CompletionRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req.model)
    if req.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is supported only equal to n", param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", param="echo")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
    prompts = await _prompts(ctx, req.prompt)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    engine_requests = []
    for i, (_, ids) in enumerate(prompts):
        max_tokens = ctx.max_tokens(req.max_tokens, len(ids), _DEFAULT_MAX_TOKENS)
        engine_requests.append((f"{completion_id}-{i}", ids, ctx.sampling_params(req, max_tokens, req.logprobs)))
    view = _CompletionView(ctx, req, completion_id, prompts, request.state.request_id)
    return await ctx.respond(request, engine_requests, arrival, req.stream, view.collect, view.events)


async def _prompts(ctx: ServingContext, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of the batch."""
    if isinstance(prompt, str):
        return [(prompt, await ctx.encode(prompt))]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt", code="empty_prompt")
    if isinstance(prompt[0], int):
        return [(None, ctx.check_prompt_ids(prompt))]
    if isinstance(prompt[0], str):
        return [(p, await ctx.encode(p)) for p in prompt]
    return [(None, ctx.check_prompt_ids(p)) for p in prompt]


class _CompletionView:
    def __init__(self, ctx: ServingContext, req: CompletionRequest, completion_id: str,
                 prompts: list[tuple[str | None, list[int]]], request_id: str) -> None:
        self.ctx = ctx
        self.req = req
        self.id = completion_id
        self.prompts = prompts
        self.request_id = request_id
        self.created = int(time.time())
        self.index_base = {f"{completion_id}-{i}": i * req.n for i in range(len(prompts))}
        self.prompt_tokens = sum(len(ids) for _, ids in prompts)

    def _prompt_text(self, choice: int) -> str:
        text, ids = self.prompts[choice // self.req.n]
        return text if text is not None else self.ctx.tokenizer.decode(ids)

    def _logprobs(self, token_ids: list[int], entries, offset: int) -> tuple[dict, int]:
        ctx, num = self.ctx, self.req.logprobs
        entries = entries or [{}] * len(token_ids)
        tokens = [ctx.token_str(t) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens,
                "token_logprobs": [clamp_logprob(e.get(t, -float("inf"))) for t, e in zip(token_ids, entries)],
                "top_logprobs": [dict(ctx.top_logprobs(e, num)) for e in entries],
                "text_offset": offsets}, offset

    def _body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    async def collect(self, outputs: AsyncIterator[RequestDelta]) -> dict:
        texts: dict[int, list[str]] = defaultdict(list)
        tokens: dict[int, list[int]] = defaultdict(list)
        entries: dict[int, list] = defaultdict(list)
        finish: dict[int, str] = {}
        async for delta in outputs:
            base = self.index_base[delta.request_id]
            for s in delta.outputs:
                k = base + s.index
                texts[k].append(s.text)
                tokens[k].extend(s.token_ids)
                entries[k].extend(s.logprobs or ())
                if s.finish_reason:
                    finish[k] = s.finish_reason
        choices = []
        for k in range(len(self.prompts) * self.req.n):
            text = "".join(texts[k])
            if self.req.echo:
                text = self._prompt_text(k) + text
            logprobs = self._logprobs(tokens[k], entries[k], 0)[0] if self.req.logprobs is not None else None
            choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish.get(k)})
        body = self._body(choices)
        body["usage"] = usage(self.prompt_tokens, sum(len(t) for t in tokens.values()))
        return body

    async def _chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncIterator[dict]:
        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        offsets: dict[int, int] = defaultdict(int)
        echoed: set[int] = set()
        completion_tokens = 0
        async for delta in outputs:
            base = self.index_base[delta.request_id]
            for s in delta.outputs:
                k = base + s.index
                completion_tokens += len(s.token_ids)
                text = s.text
                if self.req.echo and k not in echoed:
                    echoed.add(k)
                    text = self._prompt_text(k) + text
                logprobs = None
                if self.req.logprobs is not None:
                    logprobs, offsets[k] = self._logprobs(s.token_ids, s.logprobs, offsets[k])
                elif not text and s.finish_reason is None:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                chunk = self._body([{"index": k, "text": text, "logprobs": logprobs,
                                     "finish_reason": s.finish_reason}])
                if include_usage:
                    chunk["usage"] = None
                yield chunk
        if include_usage:
            chunk = self._body([])
            chunk["usage"] = usage(self.prompt_tokens, completion_tokens)
            yield chunk

    def events(self, first: RequestDelta, outputs: AsyncIterator[RequestDelta]) -> AsyncIterator[bytes]:
        return sse_stream(self._chunks(chain(first, outputs)), outputs, self.request_id)
