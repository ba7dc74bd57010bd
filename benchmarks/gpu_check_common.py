"""What the sections of benchmarks/gpu_check.py share: the settings the parent passes to each
section's process, an engine whose failed steps end the section with their traceback, a step timer
that refuses to time a step that did not do what it was timed for, and the CUDA graph replay check."""
from __future__ import annotations

import gc
import itertools
import json
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "To make a cup of tea, first",
    "The mitochondria is the powerhouse of the cell because",
    "In 1969, the Apollo 11 mission",
    "A haiku about autumn leaves:",
    "The difference between a list and a tuple in Python is",
    "Photosynthesis converts sunlight into",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
]

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
TINY = {**LLAMA_31_8B, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
        "rope_scaling": None}
FAILED_REASONS = ("error", "abort")  # a benchmark request never stops early unless something broke




@dataclass(frozen=True)
class Settings:
    device: str
    smoke: bool
    tokens: int = 32
    enforce_eager: bool = False
    max_model_len: int = 4096
    max_num_seqs: int = 64
    decode_steps: int = 32
    full_load_max_model_len: int = 8192
    full_load_max_num_seqs: int = 128
    fail_section: str | None = None


class SectionFailed(RuntimeError):
    """The section cannot report what it set out to measure."""


class Watched:
    """An engine whose failed steps keep their traceback: the engine contains a step that raises
    (its requests finish with "error" and a one-line reason) and logs the traceback only at DEBUG,
    which is the part a first run on new hardware needs. `fail_after` steps, it raises on purpose."""

    def __init__(self, llm: LLM, fail_after: int | None = None):
        self.llm, self.engine = llm, llm.engine
        self.runner = getattr(llm.engine.executor, "runner", None)
        self.tracebacks: list[str] = []
        execute, calls = self.engine.executor.execute, itertools.count()

        def checked(step):
            try:
                if fail_after is not None and next(calls) >= fail_after:
                    raise RuntimeError("a failure forced by --fail-section")
                return execute(step)
            except Exception:
                self.tracebacks.append(traceback.format_exc())
                raise

        self.engine.executor.execute = checked  # type: ignore[method-assign]

    def failed(self, request_id: str, why: str | None) -> SectionFailed:
        where = self.tracebacks[-1] if self.tracebacks else "(no step raised: the engine ended the request)"
        return SectionFailed(f"request {request_id} finished with an error: {why}\nthe engine step's {where}")

    def close(self) -> None:
        self.engine.shutdown()
        self.llm = self.engine = self.runner = None  # type: ignore[assignment]
        free_device_memory()


def free_device_memory() -> None:
    """Before the next engine profiles its budget, which counts whatever is still allocated as its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepTimer:
    """Drives an engine step by step and times each step (a step ends with the sampled tokens on the
    host: device time plus the engine's host work). A request that ends with an error raises at once."""

    def __init__(self, watched: Watched, vocab: int, seed: int = 0):
        self.watched, self.engine, self.vocab = watched, watched.engine, vocab
        self.rng = random.Random(seed)
        self.tokens: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self._ids = itertools.count()

    def add_prompt(self, prompt: str | list[int], params: SamplingParams) -> str:
        rid = f"r{next(self._ids)}"
        self.prompts[rid] = self.engine.add_request(rid, prompt, params)
        self.tokens[rid] = []
        return rid

    def add(self, batch: int, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for _ in range(batch):
            self.add_prompt([self.rng.randrange(self.vocab) for _ in range(prompt_len)], params)

    def step(self) -> tuple[float, int]:
        """(seconds, tokens the step produced)."""
        t0 = time.perf_counter()
        deltas = self.engine.step()
        seconds, produced = time.perf_counter() - t0, 0
        for d in deltas:
            reasons = [o.finish_reason for o in d.outputs if o.finish_reason in FAILED_REASONS]
            if d.error is not None or reasons:
                raise self.watched.failed(d.request_id, d.error or f"finish_reason {reasons[0]}")
            for o in d.outputs:
                self.tokens[d.request_id].extend(o.token_ids)
                produced += len(o.token_ids)
        return seconds, produced

    def _checked_step(self) -> tuple[float, int]:
        if not self.engine.has_unfinished_requests():
            raise SectionFailed("the engine has no requests left, but not every request got its tokens")
        return self.step()

    def until_all_started(self) -> float:
        """Step until every request has its first token (all prompts prefilled); seconds taken."""
        total = 0.0
        while any(not t for t in self.tokens.values()):
            total += self._checked_step()[0]
        return total

    def timed(self, steps: int, batch: int) -> list[float]:
        """`steps` step times, each step producing exactly one token per sequence."""
        times = []
        for _ in range(steps):
            seconds, produced = self._checked_step()
            if produced != batch:
                raise SectionFailed(f"a timed step produced {produced} tokens for {batch} sequences")
            times.append(seconds)
        return times

    def finish(self) -> float:
        total = 0.0
        while self.engine.has_unfinished_requests():
            total += self.step()[0]
        return total

    def generate(self, prompts: list, max_tokens: int) -> list[tuple[list[int], list[int]]]:
        """Greedy (prompt ids, tokens) per prompt."""
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        rids = [self.add_prompt(p, params) for p in prompts]
        self.finish()
        return [(self.prompts[r], self.tokens[r]) for r in rids]


class Run:
    """One section's process: its settings, its figures (saved after each measurement, so a section
    that is killed still leaves what it had measured) and the engines it starts."""

    def __init__(self, name: str, settings: Settings, tmp: Path, save: Callable[[], None], figures: dict):
        self.name, self.s, self.tmp, self.save, self.out = name, settings, tmp, save, figures

    @property
    def on_gpu(self) -> bool:
        return self.s.device == "cuda"

    def model(self, geometry: dict) -> str:
        path = self.tmp / f"config_{geometry['hidden_size']}.json"
        path.write_text(json.dumps(geometry, indent=1))
        return str(path)

    def engine(self, model: str, **engine_args) -> Watched:
        fail_after = 1 if self.s.fail_section == self.name else None
        return Watched(LLM(model, **engine_args), fail_after)

    def kv_args(self, cpu_bytes: int, utilization: float = 0.9) -> dict:
        return {"gpu_memory_utilization": utilization} if self.on_gpu else {"kv_cache_memory_bytes": cpu_bytes}

    def geometry(self) -> dict:
        return TINY if self.s.smoke else LLAMA_31_8B

    def big_engine(self, **engine_args) -> Watched:
        """The Llama-3.1-8B geometry (tiny on a smoke run) with dummy weights."""
        t0 = time.perf_counter()
        engine_args = {"enforce_eager": self.s.enforce_eager, **engine_args}
        watched = self.engine(self.model(self.geometry()), load_format="dummy", device=self.s.device,
                              dtype="bfloat16" if self.on_gpu else "float32", enable_prefix_caching=False,
                              **engine_args)
        self.out["startup_s"] = time.perf_counter() - t0
        self.out["memory"] = memory_report(watched.runner)
        print(f"started in {self.out['startup_s']:.1f} s; {self.out['memory'].get('breakdown', 'explicit KV budget')}",
              flush=True)
        self.save()
        return watched


def memory_report(runner) -> dict:
    budget = getattr(runner, "kv_budget", None)
    if budget is None:
        return {"kv_budget": "explicit kv_cache_memory_bytes (no profile)"}
    p = budget.profile
    return {"breakdown": budget.describe(), "total_bytes": p.total_bytes, "utilization": budget.utilization,
            "weights_bytes": p.weights_bytes, "activation_peak_bytes": p.activation_peak_bytes,
            "non_torch_bytes": p.non_torch_bytes, "cuda_graph_bytes": p.cuda_graph_bytes,
            "allocator_slack_bytes": p.allocator_slack_bytes, "reserve_bytes": budget.reserve_bytes,
            "kv_bytes": budget.kv_bytes, "num_blocks": budget.num_blocks}


def graph_replays(runner) -> int | None:
    graphs = getattr(runner, "graphs", None)
    return None if graphs is None else getattr(graphs, "replays", None)


def check_graphs(run: Run, runner, replays_before: int, decode_steps: int | None) -> dict:
    """The replays since `replays_before`. On CUDA with graphs asked for, a decode step that ran
    eagerly fails the section: `decode_steps` None asks for at least one replay."""
    after = graph_replays(runner)
    report = {"graph_sizes": list(getattr(runner, "graph_sizes", [])),
              "graph_replays": None if after is None else after - replays_before}
    if run.on_gpu and not run.s.enforce_eager:
        if not report["graph_sizes"] or after is None:
            raise SectionFailed("CUDA graphs were asked for (no --enforce-eager) but decode steps ran eagerly: "
                                f"captured sizes {report['graph_sizes']}, replay counter {after}")
        expected = 1 if decode_steps is None else decode_steps
        if report["graph_replays"] < expected:
            raise SectionFailed(f"{report['graph_replays']} CUDA graph replays for {expected} decode step(s): "
                                "the rest ran eagerly")
    return report
