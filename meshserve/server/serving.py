"""What completions and chat completions share: body parsing, model check, admission, prompt
tokenization and checks, SamplingParams, the generate-and-respond flow, and the response base class."""
from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from meshserve.api.chunks import response_body, usage
from meshserve.api.errors import APIError, bad_request, error_body, from_value_error
from meshserve.api.limits import resolve_max_tokens
from meshserve.api.load import SSE_LOAD_PREFIX, ReportedLoad, format_load
from meshserve.api.protocol import ChatMessage, SamplingFields
from meshserve.api.sse import (
    DONE,
    EventStreamResponse,
    JSONBytesResponse,
    cancel_on_disconnect,
    sse_event,
)
from meshserve.api.structured import constraint_of
from meshserve.engine.client import EngineClient
from meshserve.engine.errors import EngineCallError, EngineDeadError, EngineRejectedError, EngineRequestFailed
from meshserve.engine.messages import ErrorCode, RequestDelta
from meshserve.sampling_params import API_PASSTHROUGH_FIELDS, SamplingParams, StructuredOutputsParams
from meshserve.server.server_config import ServerConfig
from meshserve.server.tools import for_template, template_knows_tools, tool_calls_of
from meshserve.structured.grammars import grammar_of
from meshserve.tokenizer import tokenizer_hash

logger = logging.getLogger(__name__)

# Tokenize long texts off the event loop so one huge prompt does not stall every other stream.
_THREAD_TOKENIZE_CHARS = 20_000
# JSON has no -inf; a token outside the sampling support gets this instead.
_MIN_LOGPROB = -9999.0
# A request that draws on a KV reservation (POST /v1/reservations) names it here.
RESERVATION_HEADER = "x-reservation-id"
# "1": every streamed choice also carries the ids of its new tokens (what a gateway needs to resume
# a stream elsewhere), and chunks with tokens but no text yet are sent too.
TOKEN_IDS_HEADER = "x-meshserve-token-ids"


class ServingContext:
    """The state handlers share: engine client, tokenizer, names, limits."""

    def __init__(self, client: EngineClient, config: ServerConfig) -> None:
        info = client.info
        if info is None:
            raise RuntimeError("ServingContext needs a started EngineClient: call client.start() first")
        self.client = client
        self.config = config
        self.tokenizer = info.tokenizer
        self.model_info = info.model
        self.max_model_len: int = info.model.max_model_len
        # Token ids must exist for the tokenizer (to print them) and the model (to embed them).
        sizes = [v for v in (getattr(self.tokenizer, "vocab_size", None), info.model.vocab_size) if v is not None]
        self.vocab_size: int | None = min(sizes) if sizes else None
        self.model_name: str = info.model.id  # the served name when one was given
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        # What a router needs to know before it trusts a prefix cached here: the weights, how text
        # becomes tokens, and how the engine groups tokens into cache blocks.
        self.identity = {"revision": info.model.revision,
                         "block_size": int(info.config.get("block_size") or 16),
                         "tokenizer_hash": tokenizer_hash(self.tokenizer),
                         "chat_template_hash": _digest(getattr(self.tokenizer, "chat_template", None) or "")}

    def load_report(self) -> str:
        """The X-Meshserve-Load value: this server's figures now (requests not yet handed to an
        engine count as waiting)."""
        s = self.client.stats().engines
        return format_load(ReportedLoad(
            running=s.num_running, waiting=max(s.num_waiting, self.client.num_queued_seqs),
            pending_prefill=s.pending_prefill_tokens, free_blocks=s.num_free_blocks, blocks=s.num_blocks,
            reserved_blocks=s.reserved_blocks, kv=s.kv_cache_usage))

    # ---- checks -------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def admit(self, num_seqs: int) -> None:
        """Refuse work the server cannot take now: no engine running (503), or a waiting queue that
        cannot hold the request's sequences (prompts x n): 429 while it is full, 400 if the request
        alone is larger than the queue may ever be."""
        if not self.client.healthy:
            raise APIError(503, "no engine is running (it is being restarted)", code="engine_unavailable",
                           headers={"Retry-After": "5"})
        limit = self.config.max_queued_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise bad_request(f"the request has {num_seqs} sequences (prompts x n), more than "
                              f"--max-queued-requests ({limit}) allows at once", param="n",
                              code="request_too_large")
        if self.client.num_queued_seqs + num_seqs > limit:
            raise APIError(429, f"the waiting queue is full ({limit} sequences)", code="queue_full",
                           headers={"Retry-After": "1"})

    def check_prompt_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty", param=param, code="empty_prompt")
        if self.vocab_size is not None:
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                                  param=param)
        return ids

    def max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The output budget; prompt plus output must fit the context (checked before any model work)."""
        return resolve_max_tokens(requested, prompt_len, self.max_model_len, default)

    def sampling_params(self, req: SamplingFields, max_tokens: int, logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """`constraint`: what the output must match when the endpoint decides it (a tool choice);
        otherwise the request's own response_format / structured_outputs, checked here (a 400
        naming the field) before anything is queued."""
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        constraint = constraint or constraint_of(req)
        if constraint is not None:
            try:
                grammar_of(constraint)
            except ValueError as exc:
                raise APIError(400, str(exc), param="response_format" if req.response_format is not None
                               else "structured_outputs", code="invalid_parameter") from None
        given = {name: value for name in API_PASSTHROUGH_FIELDS if (value := getattr(req, name)) is not None}
        try:  # what the client left out takes SamplingParams' defaults
            return SamplingParams(n=req.n, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=constraint,
                                  **given)
        except ValueError as exc:
            raise from_value_error(exc) from None

    # ---- tokenizer ----------------------------------------------------------------------------
    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        if not text:  # checked on the text: a BOS token alone is no prompt either
            raise bad_request("the prompt is empty", param=param, code="empty_prompt")
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(encode) if len(text) > _THREAD_TOKENIZE_CHARS else encode()

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Chat messages (and the tools the answer may call) -> the prompt's token ids, as
        /v1/chat/completions and /tokenize see them. A template that knows tools renders them
        itself; for others they are written into the messages (tools.for_template)."""
        knows_tools = template_knows_tools(getattr(self.tokenizer, "chat_template", None))
        msgs, template_tools = for_template([_message(m) for m in messages], tools, knows_tools)
        try:
            text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                      tools=template_tools)
        except Exception as exc:  # the template's own checks (roles, order) speak for themselves
            raise bad_request(f"messages: {exc}", param="messages") from None
        # The template already wrote the special tokens it wants (as LLM.chat does).
        return await self.encode(text, "messages", add_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def top_logprobs(self, entry: dict[int, float], num: int) -> list[tuple[str, float]]:
        best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:num]
        return [(self.token_str(t), clamp_logprob(lp)) for t, lp in best]

    # ---- the flow ------------------------------------------------------------------------------
    async def respond(self, request: Request, engine_requests: list[tuple[str, list[int], SamplingParams]],
                      arrival: float, view: ResponseView[SamplingFields], kv_transfer: dict | None = None) -> Response:
        """Submit, then either collect everything into one JSON body or stream SSE events.

        A stream's headers go out only once the first output is there, so a request the engine
        rejects still gets a proper error status; after that, failures end the stream in-band."""
        self.admit(sum(params.n for _, _, params in engine_requests))
        view.return_token_ids = request.headers.get(TOKEN_IDS_HEADER) == "1"
        outputs = self.client.generate(engine_requests, arrival, lease_id=request.headers.get(RESERVATION_HEADER),
                                       owner=request.state.key_owner, cache_salt=view.req.cache_salt or "",
                                       kv_transfer=kv_transfer)

        async def run() -> Response:
            try:
                if not view.req.stream:
                    return JSONBytesResponse(await view.collect(outputs))
                first = await outputs.__anext__()
            except EngineCallError as exc:  # the reservation it names cannot cover it
                raise APIError(409, str(exc), code="reservation_invalid", request_id=view.request_id) from None
            except EngineRejectedError as exc:
                raise from_value_error(exc) from None
            except EngineDeadError as exc:
                raise APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"},
                               request_id=view.request_id) from None
            except EngineRequestFailed as exc:
                raise _ended_early(exc, view.request_id) from None
            return EventStreamResponse(view.events(first, outputs))

        try:
            return await cancel_on_disconnect(request, run())
        except BaseException:
            await outputs.aclose()
            raise


def _ended_early(exc: EngineRequestFailed, request_id: str) -> APIError:
    """A request the engine ended before its answer started: a failed step is the server's fault, a
    reservation released under it the caller's (who released it) to redo."""
    if exc.code == ErrorCode.RESERVATION_RELEASED.value:
        return APIError(409, str(exc), code=exc.code, request_id=request_id)
    return APIError(500, str(exc), type="server_error", code=exc.code, request_id=request_id)


@dataclass
class Choice:
    """One choice of a non-streamed answer, gathered from its deltas."""
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


# The endpoint's request body (covariant: a view of a chat request is a view of sampling fields).
_Req = TypeVar("_Req", bound=SamplingFields, covariant=True)


class ResponseView(Generic[_Req]):
    """Turns engine deltas into one endpoint's JSON body or SSE chunks (subclasses: the shapes)."""

    object_name = ""  # of the non-streamed body
    chunk_object_name = ""

    def __init__(self, ctx: ServingContext, req: _Req, response_id: str, request_id: str,
                 prompt_tokens: int) -> None:
        self.ctx = ctx
        self.req = req
        self.id = response_id
        self.request_id = request_id  # X-Request-Id, named in an in-band stream failure
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.include_usage = req.stream_options is not None and req.stream_options.include_usage
        self.return_token_ids = False
        self.kv_transfer: dict | None = None  # a prefill request's hand-off figures

    def choice_index(self, request_id: str, sample_index: int) -> int:
        return sample_index

    def body(self, choices: list[dict], chunk: bool = False) -> dict:
        body = response_body(self.id, self.chunk_object_name if chunk else self.object_name, self.created,
                           self.ctx.model_name, choices)
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self.body([], chunk=True), "usage": usage(self.prompt_tokens, completion_tokens)}

    async def gather(self, outputs: AsyncIterator[RequestDelta]) -> tuple[dict[int, Choice], int]:
        """Every choice of the answer, and the number of tokens generated."""
        choices: dict[int, Choice] = defaultdict(Choice)
        completion_tokens = 0
        async for delta in outputs:
            self.kv_transfer = delta.kv_transfer or self.kv_transfer
            for s in delta.outputs:
                c = choices[self.choice_index(delta.request_id, s.index)]
                c.texts.append(s.text)
                c.token_ids.extend(s.token_ids)
                c.logprobs.extend(s.logprobs or ())
                c.finish_reason = s.finish_reason or c.finish_reason
                completion_tokens += len(s.token_ids)
        return choices, completion_tokens

    async def collect(self, outputs: AsyncIterator[RequestDelta]) -> dict:
        raise NotImplementedError

    def chunks(self, outputs: AsyncIterator[RequestDelta]) -> AsyncGenerator[dict, None]:
        raise NotImplementedError

    def events(self, first: RequestDelta,
               outputs: AsyncGenerator[RequestDelta, None]) -> AsyncGenerator[bytes, None]:
        return sse_stream(self.chunks(_chain(first, outputs)), outputs, self.request_id, self.ctx.load_report)


async def sse_stream(chunks: AsyncGenerator[dict, None], outputs: AsyncGenerator[RequestDelta, None],
                     request_id: str, load_report: Callable[[], str]) -> AsyncGenerator[bytes, None]:
    """SSE framing shared by both endpoints; a failure after the stream started is reported in-band.
    The server's load figures go last, in a comment line that SSE clients skip."""
    try:
        async for obj in chunks:
            yield sse_event(obj)
    except Exception as exc:  # whatever broke, the stream ends with its error, never cut mid-body
        if isinstance(exc, (EngineDeadError, EngineRejectedError, EngineRequestFailed)):
            reason = str(exc)
        else:  # a bug in the server: its message may quote the text, so only its type is told
            reason = type(exc).__name__
            logger.error("a stream failed after it started (%s)", reason, exc_info=logger.isEnabledFor(logging.DEBUG))
        body = error_body(500, f"generation failed after the stream started: {reason}",
                          code="partial_stream_failure", request_id=request_id)
        if isinstance(exc, EngineRequestFailed):  # why the engine ended it (a gateway tells faults apart)
            body["error"]["cause"] = exc.code
        yield sse_event(body)
    finally:
        await chunks.aclose()
        await outputs.aclose()
    yield SSE_LOAD_PREFIX + load_report().encode("ascii") + b"\n\n"
    yield DONE


async def _chain(first: RequestDelta, rest: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
    yield first
    async for delta in rest:
        yield delta


def _message(m: ChatMessage) -> dict[str, Any]:
    if m.content is None:
        content = ""
    elif isinstance(m.content, str):
        content = m.content
    else:
        content = "\n".join(part.text for part in m.content)
    # Chat templates know "system"; OpenAI's newer name for it is "developer".
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = tool_calls_of(m)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def clamp_logprob(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB
