"""POST /v1/completions: one engine request per prompt; choice index = prompt index * n + sample index."""
from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.chunks import COMPLETION_OBJECT, completion_choice, usage
from meshserve.api.errors import bad_request
from meshserve.api.json_body import parse, read_json
from meshserve.api.limits import COMPLETIONS_DEFAULT_MAX_TOKENS
from meshserve.api.protocol import CompletionRequest, Prompt, is_text_batch, is_token_batch, is_token_ids
from meshserve.engine.messages import RequestDelta
from meshserve.server.serving import ResponseView, ServingContext, clamp_logprob


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
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
            and len(req.prompt) > ctx.config.max_prompts_per_request:
        raise bad_request(f"the request batches {len(req.prompt)} prompts; at most "
                          f"{ctx.config.max_prompts_per_request} are allowed (--max-prompts-per-request)",
                          param="prompt", code="too_many_prompts")
    prompts = await _prompts(ctx, req.prompt)
    if req.kv_transfer_params is not None and (len(prompts) != 1 or req.n != 1 or req.stream):
        raise bad_request("kv_transfer_params takes one prompt, n = 1 and no streaming", param="kv_transfer_params")
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    engine_requests = []
    for i, (_, ids) in enumerate(prompts):
        max_tokens = ctx.max_tokens(req.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
        engine_requests.append((f"{completion_id}-{i}", ids, ctx.sampling_params(req, max_tokens, req.logprobs)))
    view = _CompletionView(ctx, req, completion_id, prompts, request.state.request_id)
    return await ctx.respond(request, engine_requests, arrival, view, req.kv_transfer_params)


async def _prompts(ctx: ServingContext, prompt: Prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of the batch."""
    if isinstance(prompt, str):
        return [(prompt, await ctx.encode(prompt))]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt", code="empty_prompt")
    if is_token_ids(prompt):
        return [(None, ctx.check_prompt_ids(prompt))]
    if is_text_batch(prompt):
        return [(p, await ctx.encode(p)) for p in prompt]
    assert is_token_batch(prompt), "CompletionRequest allows no other shape"
    return [(None, ctx.check_prompt_ids(p)) for p in prompt]


class _CompletionView(ResponseView[CompletionRequest]):
    object_name = chunk_object_name = COMPLETION_OBJECT

    def __init__(self, ctx: ServingContext, req: CompletionRequest, completion_id: str,
                 prompts: list[tuple[str | None, list[int]]], request_id: str) -> None:
        super().__init__(ctx, req, completion_id, request_id, sum(len(ids) for _, ids in prompts))
        self.prompts = prompts
        self.index_base = {f"{completion_id}-{i}": i * req.n for i in range(len(prompts))}

    def choice_index(self, request_id: str, sample_index: int) -> int:
        return self.index_base[request_id] + sample_index

    def _prompt_text(self, choice: int) -> str:
        text, ids = self.prompts[choice // self.req.n]
        return text if text is not None else self.ctx.tokenizer.decode(ids)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None, offset: int,
                  num: int) -> tuple[dict, int]:
        """`num`: the top logprobs asked for (the request's `logprobs`)."""
        ctx = self.ctx
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

    async def collect(self, outputs: AsyncIterator[RequestDelta]) -> dict:
        gathered, completion_tokens = await self.gather(outputs)
        choices = []
        for k in range(len(self.prompts) * self.req.n):
            c = gathered[k]
            text = self._prompt_text(k) + c.text if self.req.echo else c.text
            logprobs = (self._logprobs(c.token_ids, c.logprobs, 0, self.req.logprobs)[0]
                        if self.req.logprobs is not None else None)
            choices.append(completion_choice(k, text, logprobs, c.finish_reason))
        body = {**self.body(choices), "usage": usage(self.prompt_tokens, completion_tokens)}
        if self.kv_transfer is not None:
            body["kv_transfer"] = self.kv_transfer
        return body

    async def chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncGenerator[dict, None]:
        offsets: dict[int, int] = defaultdict(int)
        echoed: set[int] = set()
        completion_tokens = 0
        async for delta in outputs:
            for s in delta.outputs:
                k = self.choice_index(delta.request_id, s.index)
                completion_tokens += len(s.token_ids)
                text = s.text
                if self.req.echo and k not in echoed:
                    echoed.add(k)
                    text = self._prompt_text(k) + text
                logprobs = None
                if self.req.logprobs is not None:
                    logprobs, offsets[k] = self._logprobs(s.token_ids, s.logprobs, offsets[k], self.req.logprobs)
                elif not text and s.finish_reason is None and not self.return_token_ids:
                    continue  # nothing to show yet (e.g. half of a multi-byte character)
                yield self.body([completion_choice(k, text, logprobs, s.finish_reason,
                                                   s.token_ids if self.return_token_ids else None)], chunk=True)
        if self.include_usage:
            yield self.usage_chunk(completion_tokens)
