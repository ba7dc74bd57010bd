"""The engine's side of structured outputs: one parser (llguidance matcher) per constrained sequence,
advanced with every token it samples, and the token mask of each constrained row of a step.

A constraint is compiled once (a prototype matcher per distinct grammar, kept in a bounded cache)
on a background thread, so a step never waits on a compile: the request's sequences join the
scheduler only when their parsers are ready. Each sequence gets its own copy of the prototype. The
masks of a step's constrained rows are filled together (llguidance's executor, in parallel, without
the GIL) as the step is packed; unconstrained rows carry none and the sampler leaves them alone.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

from meshserve.structured.grammars import CACHE_SIZE, grammar_of

if TYPE_CHECKING:
    from meshserve.engine.sequence import Sequence
    from meshserve.sampling_params import StructuredOutputsParams
    from meshserve.tokenizer import Tokenizer


def mask_bytes(vocab_size: int) -> int:
    """Bytes of one row's mask: a bit per token id, in 32-bit words."""
    return 4 * -(-vocab_size // 32)


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer: Any = None
        self._executor: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshserve-grammar")
        self._prototypes: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()  # the prototypes are shared with the compile thread
        self._matchers: dict[int, Any] = {}  # seq id -> its parser
        self._compiling: dict[str, concurrent.futures.Future[Any]] = {}  # grammar -> its compile, in flight
        self._held: dict[str, tuple[Any, concurrent.futures.Future[Any]]] = {}  # request id -> (request, compile)

    # ---- compile ------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future[Any]:
        """Start compiling (or find compiled) the constraint; the future's result is its prototype.
        ValueError at once for a constraint that is not valid."""
        grammar = grammar_of(params)
        with self._lock:
            prototype = self._prototypes.get(grammar)
            if prototype is not None:
                self._prototypes.move_to_end(grammar)
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                done.set_result(prototype)
                return done
        running = self._compiling.get(grammar)
        if running is not None and not running.done():  # requests that came together share a compile
            return running
        future = self._compiling[grammar] = self._pool.submit(self._build, grammar)
        for g in [g for g, f in self._compiling.items() if f.done()]:
            del self._compiling[g]
        return future

    def _build(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        with self._lock:
            self._prototypes[grammar] = matcher
            while len(self._prototypes) > CACHE_SIZE:
                self._prototypes.popitem(last=False)
        return matcher

    def _ll(self) -> Any:
        """The tokenizer as llguidance sees it (built once: about half a second)."""
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer

            self._ll_tokenizer = LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                             eos_token=self._eos or None)
        return self._ll_tokenizer

    # ---- requests waiting for their parsers -------------------------------------------------
    def hold(self, request: Any, params: StructuredOutputsParams) -> None:
        """Keep a constrained request out of the scheduler until its parsers are ready (ValueError
        at once for a constraint that is not valid)."""
        self._held[request.request_id] = (request, self.compile(params))

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def ready(self, wait_s: float = 0.0) -> list[tuple[Any, str | None]]:
        """(request, None) for each held request whose sequences now have their parsers, and
        (request, why) for one whose constraint failed to compile. `wait_s`: how long to wait for
        the first compile to finish when none has yet (an engine with nothing else to do)."""
        if wait_s and self._held and not any(f.done() for _, f in self._held.values()):
            concurrent.futures.wait([f for _, f in self._held.values()], wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        out: list[tuple[Any, str | None]] = []
        for request_id, (request, future) in list(self._held.items()):
            if not future.done():
                continue
            del self._held[request_id]
            try:
                prototype = future.result()
            except ValueError as exc:
                out.append((request, str(exc)))
                continue
            for seq in request.seqs:
                self.attach(seq, prototype)
            out.append((request, None))
        return out

    def release(self, request: Any) -> None:
        """A request ends (finished, aborted, failed): drop what is kept for it."""
        self._held.pop(request.request_id, None)
        self.forget([s.seq_id for s in request.seqs])

    # ---- sequences ----------------------------------------------------------------------------
    def attach(self, seq: Sequence, prototype: Any) -> None:
        """Give a sequence its own parser, caught up with what it has generated already."""
        matcher = prototype.deep_copy()
        if seq.output_token_ids:
            matcher.consume_tokens(seq.output_token_ids)
        self._matchers[seq.seq_id] = matcher

    def constrained(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matchers

    def fill_masks(self, seqs: list[Sequence]) -> list[bytes]:
        """The token masks of these constrained sequences' next tokens, in their order."""
        import numpy as np
        from llguidance import LLExecutor

        if self._executor is None:
            self._executor = LLExecutor()
        row = mask_bytes(self.vocab_size)
        out = np.zeros((len(seqs), row // 4), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(self._matchers[s.seq_id], i) for i, s in enumerate(seqs)],
                                               out.ctypes.data, row, len(seqs))
        return [out[i].tobytes() for i in range(len(seqs))]

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feed the sampled token to the sequence's parser; True when the constraint admits no more
        tokens (the sample is complete)."""
        matcher = self._matchers[seq.seq_id]
        matcher.consume_token(token)
        return bool(matcher.is_stopped() or matcher.is_error())

    def accepting(self, seq: Sequence) -> bool:
        matcher = self._matchers.get(seq.seq_id)
        return matcher is None or bool(matcher.is_accepting())

    def forget(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self._matchers.pop(s, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
