"""LLM: the offline Python API (vLLM-style) over LLMEngine."""
from __future__ import annotations

import itertools
from typing import Sequence

from tqdm import tqdm

from meshserve.config import EngineConfig
from meshserve.engine.llm_engine import LLMEngine
from meshserve.outputs import RequestOutput
from meshserve.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    """`LLM()` serves the embedded default model; keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = "default", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
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
        # Validate every prompt before any is queued, so a bad one leaves nothing half-submitted.
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, params)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in request_ids]
