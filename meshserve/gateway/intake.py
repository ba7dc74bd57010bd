"""What the gateway checks before a request takes anything (a tokenizer call, a queue slot, a quota,
a lease): the request's shape and sampling parameters (the rules SamplingParams holds), its prompt
count, its token ids against the model's vocabulary, and whether any replica could ever hold its
KV. A request that fails here is the client's mistake: a 4xx at once, nothing charged to anyone.

Prompts are tokenized by a replica's /tokenize (so the context check and the prefix index see the
ids the engine will), at most `tokenize_concurrency` calls at a time for one request.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp

from meshserve.api.errors import APIError, bad_request, from_value_error
from meshserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    is_text_batch,
    is_token_batch,
    is_token_ids,
)
from meshserve.gateway.config import GatewayConfig
from meshserve.gateway.replicas import Replica, ReplicaIdentity, ReplicaSet
from meshserve.sampling_params import API_PASSTHROUGH_FIELDS, SamplingParams

Request = CompletionRequest | ChatCompletionRequest


def check_request(req: Request, config: GatewayConfig) -> None:
    """The request's own rules, before its prompt is looked at: 400 naming the field."""
    if isinstance(req, CompletionRequest) and (is_text_batch(req.prompt) or is_token_batch(req.prompt)):
        count = len(req.prompt)
        if count > config.max_prompts_per_request:
            raise bad_request(f"the request batches {count} prompts; at most {config.max_prompts_per_request} "
                              "are allowed (--max-prompts-per-request)", param="prompt", code="too_many_prompts")
    given = {name: value for name in API_PASSTHROUGH_FIELDS if (value := getattr(req, name)) is not None}
    try:  # the replica builds the same SamplingParams: what it would refuse is refused here
        SamplingParams(n=req.n, max_tokens=None, **given)
    except ValueError as exc:
        raise from_value_error(exc) from None


def check_token_ids(prompts: list[list[int]], identity: ReplicaIdentity) -> None:
    if not prompts or not all(prompts):
        raise bad_request("the prompt is empty", param="prompt", code="empty_prompt")
    vocab = identity.vocab_size
    if vocab is None:
        return
    bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")


def check_capacity(replicas: list[Replica], prompts: list[list[int]], max_tokens: int, n: int) -> None:
    """413 when no replica's whole KV cache could ever hold the request (each prompt's samples, less
    the most a cached prefix could save), whatever else ran: it would otherwise wait its deadline out."""
    sizes = [(r.reported.blocks, r.identity.block_size) for r in replicas
             if r.reported is not None and r.reported.blocks and r.identity is not None and r.identity.block_size]
    if not sizes:
        return  # no replica says how large it is (another engine): its own answer will tell
    largest = max(blocks for blocks, _ in sizes)
    need = min(_fewest_blocks(max(len(p) for p in prompts), max_tokens, n, block) for _, block in sizes)
    if need > largest:
        raise APIError(413, f"the request needs at least {need} KV blocks ({n} samples of up to "
                            f"{max(len(p) for p in prompts)} prompt + {max_tokens} output tokens), more than the "
                            f"largest replica holds ({largest}); lower n or max_tokens",
                       param="max_tokens", code="request_too_large")


def _fewest_blocks(prompt_len: int, max_tokens: int, n: int, block: int) -> int:
    """The fewest blocks an engine could grant this request: its prefix blocks cached and shared."""
    shared = (prompt_len - 1) // block
    return n * (-(-(prompt_len + max_tokens) // block) - shared) + shared


class Tokenizing:
    def __init__(self, config: GatewayConfig, session: aiohttp.ClientSession, replicas: ReplicaSet) -> None:
        self.config = config
        self.session = session
        self.replicas = replicas
        self._turn = itertools.count()

    async def prompts(self, req: Request, raw: dict[str, Any]) -> tuple[ReplicaIdentity, list[list[int]], int]:
        """(identity of the replica that tokenized, token ids per prompt, its context length)."""
        known = [r.identity for r in self.replicas.replicas if r.identity is not None]
        if req.model is not None and known and all(identity.model != req.model for identity in known):
            served = sorted({identity.model for identity in known})
            raise APIError(404, f"the model {req.model!r} does not exist; this gateway serves "
                                f"{', '.join(map(repr, served))}", param="model", code="model_not_found")
        candidates = self.replicas.compatible(req.model)
        if not candidates:
            raise APIError(503, "no healthy replica serves this model now", code="no_healthy_replica",
                           headers={"Retry-After": "2"})
        bodies, ids = _to_tokenize(req, raw)
        start = next(self._turn)
        last_error: Exception | None = None
        for k in range(min(2, len(candidates))):  # a replica that fails here is tried once elsewhere
            replica = candidates[(start + k) % len(candidates)]
            identity = replica.known_identity
            try:
                if not bodies:  # token ids already (or no prompt at all: `[]`)
                    check_token_ids(ids, identity)
                    return identity, ids, identity.max_model_len
                gate = asyncio.Semaphore(self.config.tokenize_concurrency)
                results = await asyncio.gather(*(self._tokenize_on(replica, b, gate) for b in bodies))
                return identity, [r["tokens"] for r in results], int(results[0]["max_model_len"])
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.replicas.record_failure(replica, f"tokenize: {type(exc).__name__}",
                                             decisive=isinstance(exc, aiohttp.ClientConnectorError))
                last_error = exc
        raise APIError(503, f"no replica could tokenize the prompt ({type(last_error).__name__})",
                       code="no_healthy_replica", headers={"Retry-After": "1"})

    async def _tokenize_on(self, replica: Replica, body: dict[str, Any], gate: asyncio.Semaphore) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=self.config.connect_timeout_s)
        async with gate, self.session.post(replica.url + "/tokenize", json=body, timeout=timeout) as resp:
            answer: dict[str, Any] = await resp.json(content_type=None)
            if resp.status == 200:
                return answer
            if resp.status >= 500:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            err = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise APIError(resp.status, err.get("message", "the prompt was refused"), param=err.get("param"),
                           code=err.get("code"))


def _to_tokenize(req: Request, raw: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """(the /tokenize bodies of its prompts, or its prompts when they came as token ids already)."""
    if isinstance(req, ChatCompletionRequest):  # rendered as the replica will: with its tools
        body = {"messages": raw["messages"], "add_generation_prompt": req.add_generation_prompt}
        body.update({k: raw[k] for k in ("tools", "tool_choice") if raw.get(k) is not None})
        return [body], []
    if isinstance(req.prompt, str):
        return [{"prompt": req.prompt}], []
    if is_text_batch(req.prompt):
        return [{"prompt": p} for p in req.prompt], []
    if is_token_ids(req.prompt):
        return [], [req.prompt]
    if is_token_batch(req.prompt):
        return [], list(req.prompt)
    return [], []
