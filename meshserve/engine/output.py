"""What a request has produced so far, and the delta of each step.

Each sample (one of n) detokenizes incrementally, checks stop strings on a bounded window and holds
back the last characters that could still be the start of a stop string. A step hands out only
what is new (`EngineRequest.take_delta`): the work per step is proportional to the tokens generated
in it, never to the length of the answer so far.
"""
from __future__ import annotations

from meshserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from meshserve.engine.messages import ErrorCode, RequestDelta, SampleDelta
from meshserve.engine.sequence import Sequence
from meshserve.outputs import RequestMetrics
from meshserve.sampling_params import SamplingParams
from meshserve.tokenizer import Tokenizer


class SampleState:
    __slots__ = ("index", "detok", "stops", "include_stop", "holdback", "token_ids", "logprobs",
                 "emitted_chars", "pending", "sent_tokens", "finish_reason", "stop_reason", "reported", "rendered")

    def __init__(self, index: int, detok: IncrementalDetokenizer, params: SamplingParams) -> None:
        self.index = index
        self.detok = detok
        self.stops = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        # While a stop string may still match, its first len - 1 characters must not go out yet.
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.emitted_chars = 0  # characters handed out in deltas
        self.pending = ""  # text produced but not handed out yet (held back for stop strings)
        self.sent_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.reported = False  # the finish has gone out in a delta
        self.rendered = 0  # tokens whose text is in `pending` (or out)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, lp: tuple[float, list[tuple[int, float]]] | None, final: bool,
               check_stops: bool) -> None:
        """Add one generated token. `final`: the sample ends with it (EOS, a length limit), so its
        last text is flushed. `check_stops`: stop strings may match now (min_tokens reached)."""
        self.push(token, lp)
        self.render(final, check_stops)

    def push(self, token: int, lp: tuple[float, list[tuple[int, float]]] | None) -> None:
        """Record a token; its text comes with the next `render` (which a sample without stop strings
        may leave until the next step is under way: its text cannot change what is scheduled)."""
        self.token_ids.append(token)
        if lp is not None and self.logprobs is not None:
            chosen, top = lp
            entry = dict(top)
            entry[token] = chosen
            self.logprobs.append(entry)

    def render(self, final: bool, check_stops: bool) -> None:
        """Detokenize the tokens pushed since the last render; check stop strings on the new text."""
        delta = self.detok.add_many(self.token_ids[self.rendered:])
        self.rendered = len(self.token_ids)
        if final:
            delta += self.detok.flush()
        if not delta:
            return
        window = self.pending + delta
        if self.stops and check_stops:
            hit = find_stop(window, len(delta), self.stops)
            if hit is not None:
                i, s = hit
                self.pending = window[:i + len(s)] if self.include_stop else window[:i]
                self.finish("stop", s)
                return
        self.pending = window

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def take_delta(self) -> SampleDelta | None:
        """What is new since the last delta (its tokens' text rendered first), or None when nothing moved."""
        if self.rendered < len(self.token_ids):
            self.render(self.finished, check_stops=False)
        new_tokens = len(self.token_ids) - self.sent_tokens
        if new_tokens == 0 and (self.reported or not self.finished):
            return None
        if self.finished:
            text, self.pending = self.pending, ""
            self.reported = True
        else:
            cut = max(0, len(self.pending) - self.holdback)
            text, self.pending = self.pending[:cut], self.pending[cut:]
        self.emitted_chars += len(text)
        start, self.sent_tokens = self.sent_tokens, len(self.token_ids)
        return SampleDelta(self.index, text, self.token_ids[start:],
                           self.logprobs[start:] if self.logprobs is not None else None,
                           self.finish_reason, self.stop_reason)


class EngineRequest:
    """One request in the engine: its sequences' outputs, timestamps, and what was handed out."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: Tokenizer,
                 arrival: float, seqs: list[Sequence], final_only: bool = False) -> None:
        self.request_id, self.prompt_ids, self.params, self.seqs = request_id, prompt_ids, params, seqs
        self.samples = [SampleState(i, IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_ids),
                                    params) for i in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.error: str | None = None
        self.error_code: ErrorCode | None = None  # why the engine ended it early
        self.lease_id: str | None = None  # the KV reservation it draws on
        self.eos_token_ids: tuple[int, ...] = ()  # the ids that end its samples (none with ignore_eos)
        # Its output goes out in one delta when it ends (LLM.generate reads nothing before): its
        # text is rendered then, in one pass, not a token at a time (stop strings still are).
        self.final_only = final_only

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def finish_all(self, reason: str) -> None:
        for s in self.samples:
            s.finish(reason)

    def take_delta(self) -> RequestDelta | None:
        outputs = [d for d in (s.take_delta() for s in self.samples) if d is not None]
        if not outputs:
            return None
        finished = self.finished
        return RequestDelta(self.request_id, outputs, finished, error=self.error if finished else None,
                            error_code=self.error_code if finished else None,
                            metrics=self.metrics if finished else None)
