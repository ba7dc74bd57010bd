"""How close the decode-step model comes to a measured step on this machine.

`compare_decode_steps` takes any `measure(batch, context) -> seconds` callable, so the same
comparison runs against a plain PyTorch forward pass today and against the meshserve engine
once it can be timed per step. `torch_reference_timer` is the plain-PyTorch one: a Llama
architecture built from a `ModelSpec` with random weights (transformers' LlamaForCausalLM).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Callable

from .specs import ModelSpec
from .timing import PerfModel

StepTimer = Callable[[int, int], float]
"""measure(batch, context): seconds for one decode step of `batch` sequences that each hold
`context` cached tokens."""


@dataclass(frozen=True)
class FidelityPoint:
    batch: int
    context: int
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        """measured / predicted: > 1 means the machine is slower than the model says."""
        return self.measured_s / self.predicted_s


def compare_decode_steps(perf: PerfModel, measure: StepTimer, batches: list[int],
                         context: int) -> list[FidelityPoint]:
    return [FidelityPoint(b, context, perf.decode_step_time(b, context), measure(b, context))
            for b in batches]


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
