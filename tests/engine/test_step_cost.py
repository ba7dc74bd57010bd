"""The engine's own work per step (scheduling, packing, output processing, deltas) must not grow with
the length of the answers: a step at 4,000 generated tokens costs what a step at 40 costs.

The model is replaced by a stub that samples a fixed cycle of tokens, so only the engine's host work
is timed; the request uses penalties, logprobs and stop strings so every per-token path runs."""
import json
import statistics
import time

from meshserve.config import EngineConfig
from meshserve.engine.llm_engine import LLMEngine
from meshserve.layers.sampler import SamplerOutput
from meshserve.sampling_params import SamplingParams
from meshserve.worker.step import StepResult

LONG = 4000


def _engine(tmp_path) -> LLMEngine:
    tmp_path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 49152,
           "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy",
                                    max_model_len=LONG + 512, kv_cache_memory_bytes=8 << 20))
    counter = iter(range(10**9))

    def stub_execute(step):  # one sampled token per sampling sequence, ordinary words
        rows = [s for s in step.seqs if s.sample]
        tokens = [1000 + next(counter) % 97 for _ in rows]
        return StepResult(SamplerOutput(tokens, [(-0.5, [(t, -0.5), (t + 1, -1.5)]) for t in tokens]))

    engine.executor.execute = stub_execute
    return engine


def _step_times(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def _paired_typical_steps(a, b, blocks: int = 9, steps: int = 40) -> tuple[float, float]:
    """Each engine's quietest block's median step time, blocks alternating between them: other
    processes on a shared machine only add time, and a busy spell then hits both alike."""
    times_a, times_b = [], []
    for _ in range(blocks):
        times_a.append(statistics.median(_step_times(a, steps)))
        times_b.append(statistics.median(_step_times(b, steps)))
    return min(times_a), min(times_b)


def _started(tmp_path, name: str):
    engine = _engine(tmp_path / name)
    params = SamplingParams(temperature=0, max_tokens=LONG + 1000, ignore_eos=True, logprobs=2,
                            presence_penalty=0.5, repetition_penalty=1.1, stop=["never appears here"])
    engine.add_request("r", list(range(2000, 2032)), params)
    engine.step()  # prefill
    return engine


def test_host_work_per_step_does_not_grow_with_output_length(tmp_path):
    long_engine = _started(tmp_path, "long")
    while len(long_engine.requests["r"].samples[0].token_ids) < LONG:
        long_engine.step()
    short_engine = _started(tmp_path, "short")
    _step_times(short_engine, 40)
    short, long = _paired_typical_steps(short_engine, long_engine)  # at 40-400 tokens and ~4,000
    ratio = long / short
    assert ratio < 1.5, f"a step at {LONG} tokens costs {ratio:.2f}x a step at 40-400"
    for engine in (short_engine, long_engine):
        assert engine.has_unfinished_requests()
    assert len(long_engine.requests["r"].samples[0].token_ids) >= LONG
