"""LLM: the offline Python API (vLLM-style) over LLMEngine."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from meshserve.config import EngineConfig
from meshserve.engine.llm_engine import LLMEngine
from meshserve.engine.messages import RequestDelta
from meshserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from meshserve.sampling_params import SamplingParams
from meshserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PromptType = str | list[int]


def _is_one_conversation(messages: list[dict] | list[list[dict]]) -> TypeIs[list[dict]]:
    return bool(messages) and isinstance(messages[0], dict)


class LLM:
    """`LLM()` serves the embedded default model; keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = "default", **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} sampling params")
        collected: dict[str, _Collected] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                rid = f"llm-{next(self._ids)}"
                ids = self.engine.add_request(rid, prompt, params, final_only=True)
                collected[rid] = _Collected(rid, prompt if isinstance(prompt, str) else None, ids, params)
            return self._run(collected, use_tqdm)
        except BaseException:
            # Whatever stopped us (a bad prompt, KeyboardInterrupt, an engine error): none of our
            # requests stays behind, so the next call starts clean.
            for rid in collected:
                self.engine.abort_request(rid)
            raise

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if _is_one_conversation(messages) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, collected: dict[str, _Collected], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(collected)
        with tqdm(total=len(collected), desc="generating", disable=not use_tqdm) as bar:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine dropped {len(pending)} request(s)")  # a bug, never expected
                for delta in self.engine.step():
                    c = collected.get(delta.request_id)
                    if c is None:
                        continue
                    c.add(delta)
                    if delta.finished:
                        pending.discard(delta.request_id)
                        bar.update(1)
        return [c.output() for c in collected.values()]


class _Collected:
    """One request's output gathered from the engine's per-step deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.texts: list[list[str]] = [[] for _ in range(params.n)]
        self.samples = [CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None)
                        for i in range(params.n)]
        self.finished = False
        self.metrics: RequestMetrics | None = None
        self.error: str | None = None

    def add(self, delta: RequestDelta) -> None:
        for d in delta.outputs:
            out = self.samples[d.index]
            self.texts[d.index].append(d.text)
            out.token_ids.extend(d.token_ids)
            if out.logprobs is not None and d.logprobs:
                out.logprobs.extend(d.logprobs)
            out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
        if delta.finished:
            self.finished, self.metrics, self.error = True, delta.metrics, delta.error

    def output(self) -> RequestOutput:
        for out, texts in zip(self.samples, self.texts):
            out.text = "".join(texts)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, self.samples, self.finished,
                             self.metrics, self.error)
