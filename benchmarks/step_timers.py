"""Timers of one decode step, `measure(batch, context) -> seconds`, for the planner's fidelity check
(`meshserve.plan.fidelity.compare_decode_steps`): `EngineStepTimer` times pure decode steps of the
meshserve engine itself (what serving costs); `torch_reference_timer` times a plain transformers
forward pass of the same geometry with random weights, a reference free of the engine's paging,
scheduling and sampling."""
from __future__ import annotations

import inspect
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable

from meshserve.models.geometry import kv_block_bytes
from meshserve.plan.fidelity import StepTimer
from meshserve.plan.specs import ModelSpec


def torch_reference_timer(spec: ModelSpec, repeats: int = 7, seed: int = 0,
                          clock: Callable[[], float] = time.perf_counter) -> StepTimer:
    """A float32 Llama-architecture model with `spec`'s geometry and random weights, timed per
    decode step: the fastest of `repeats` steps after one warm-up step. The fastest, like the
    best-of calibration, is what the machine can do when nothing else is running on it. Pass
    `clock=time.thread_time` (one torch thread) to match a `cpu_time` calibration."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    if spec.is_moe or spec.is_mla:
        raise ValueError(f"the PyTorch reference builds dense Llama models, not {spec.name}")
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size, tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.attention_bias, max_position_embeddings=spec.max_context)
    model = LlamaForCausalLM(config).eval()
    # transformers 5 calls the KV cache argument `cache`, 4.x `past_key_values`.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def step(ids, cache):
        out = model(input_ids=ids, use_cache=True, **{cache_kw: cache})
        return out.cache if cache_kw == "cache" else out.past_key_values

    def filled_cache(batch: int, context: int, gen):
        # Random keys and values stand in for a prefill: the step's cost depends on the cache's
        # size, not its contents, and skipping the prefill keeps the measurement quick.
        cache = DynamicCache()
        shape = (batch, spec.num_kv_heads, context, spec.head_dim)
        for layer in range(spec.num_layers):
            cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), layer)
        return cache

    def measure(batch: int, context: int) -> float:
        gen = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            cache = filled_cache(batch, context, gen)
            times = []
            for _ in range(repeats + 1):
                ids = torch.randint(0, spec.vocab_size, (batch, 1), generator=gen)
                start = clock()
                cache = step(ids, cache)
                times.append(clock() - start)
        return min(times[1:])

    return measure


PREFILL_TOKENS_PER_STEP = 2048  # the engine's token budget per step (chunked prefill)


class EngineStepTimer:
    """Decode steps of a meshserve engine (`LLM`, float32, one rank in this process).

    One engine serves every measurement; its KV cache is sized for `max_batch` sequences of
    `max_context` tokens plus the generated ones, and nothing more. A measurement submits `batch`
    requests of `context` random token ids (greedy, `ignore_eos`), steps the engine until every
    prompt is prefilled, then times `warmup + steps` steps in which each sequence decodes exactly
    one token, and returns the median of the last `steps`. Each step is timed around
    `engine.step()` (schedule, forward, sample, detokenize): the whole cost of a serving step.
    The median, not the fastest, since an engine step's Python work varies from step to step.

    The engine records `last_step_compute_s` itself, but in wall time only; on a shared machine
    that counts other processes' time slices. Pass `clock=time.thread_time` (with
    `torch.set_num_threads(1)`) to match a `cpu_time` calibration: the single rank runs in the
    calling thread, so its CPU time is the step's. Prompts are distinct, so every sequence reads
    its own KV blocks as distinct requests would. `close()` (or `with`) shuts the engine down.
    """

    def __init__(self, spec: ModelSpec, max_batch: int, max_context: int, steps: int = 8,
                 warmup: int = 1, seed: int = 0, clock: Callable[[], float] = time.perf_counter,
                 model: str = "default"):
        from meshserve.llm import LLM

        if spec.is_moe or spec.is_mla:
            raise ValueError(f"the engine runs dense Llama-family models, not {spec.name}")
        if not (1 <= max_batch < PREFILL_TOKENS_PER_STEP and max_context >= 1 and steps >= 1 and warmup >= 0):
            raise ValueError(f"need 1 <= max_batch < {PREFILL_TOKENS_PER_STEP}, max_context >= 1, steps >= 1 "
                             f"and warmup >= 0; got {max_batch}, {max_context}, {steps}, {warmup}")
        self.spec, self.max_batch, self.max_context = spec, max_batch, max_context
        self.steps, self.warmup, self.clock = steps, warmup, clock
        self._rng = random.Random(seed)
        self._request_ids = itertools.count()
        # Room for the prompt, the tokens the first prompts decode while later ones are still
        # prefilling (one per prefill step; those decodes take up to max_batch of each step's
        # budget), the timed steps and a spare: no sequence may reach the length limit.
        prefill_steps = math.ceil(max_batch * max_context / (PREFILL_TOKENS_PER_STEP - max_batch))
        max_len = max_context + prefill_steps + warmup + steps + 2
        block_size = 16
        kv_bytes_per_block = kv_block_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, 4)
        self.llm = LLM(model, dtype="float32", max_model_len=max_len, block_size=block_size,
                       max_num_seqs=max_batch, max_num_batched_tokens=PREFILL_TOKENS_PER_STEP,
                       enable_prefix_caching=False,
                       kv_cache_memory_bytes=max_batch * math.ceil(max_len / block_size) * kv_bytes_per_block)
        self.engine = self.llm.engine
        self._check_geometry()

    def _check_geometry(self) -> None:
        cfg, s = self.engine.source.config, self.spec
        engine = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                  cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
        planned = (s.num_layers, s.hidden_size, s.num_attention_heads, s.num_kv_heads, s.head_dim,
                   s.intermediate_size, s.vocab_size)
        if engine != planned:
            self.close()
            raise ValueError(f"the engine's model {self.engine.source.model_id} has geometry {engine} "
                             f"(layers, hidden, heads, KV heads, head dim, intermediate, vocab), "
                             f"but {s.name} has {planned}")

    def __call__(self, batch: int, context: int) -> float:
        from meshserve.sampling_params import SamplingParams

        if not (1 <= batch <= self.max_batch and 1 <= context <= self.max_context):
            raise ValueError(f"batch {batch} and context {context} must be within 1..{self.max_batch} "
                             f"and 1..{self.max_context}, the sizes this engine was built for")
        engine, sched = self.engine, self.engine.scheduler
        # No max_tokens: max_model_len leaves room for every step, and the requests are aborted after.
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        vocab = self.spec.vocab_size
        request_ids = [f"fidelity-{next(self._request_ids)}" for _ in range(batch)]
        try:
            for rid in request_ids:
                engine.add_request(rid, [self._rng.randrange(vocab) for _ in range(context)], params)
            # Prefill (chunked over as many steps as the token budget needs; prompts done early
            # decode meanwhile) until each sequence has its prompt cached and a token sampled.
            while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
                engine.step()
            times = []
            for _ in range(self.warmup + self.steps):
                before = engine.num_generation_tokens
                start = self.clock()
                engine.step()
                times.append(self.clock() - start)
                if engine.num_generation_tokens - before != batch or len(sched.running) != batch:
                    raise RuntimeError(f"batch {batch}, context {context}: a timed step decoded "
                                       f"{engine.num_generation_tokens - before} tokens with "
                                       f"{len(sched.running)} sequences running, not one for each")
        finally:
            for rid in request_ids:
                engine.abort_request(rid)
        return statistics.median(times[self.warmup:])

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> EngineStepTimer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
