"""`--step-trace FILE`: one JSON line per engine step with what the step computed and its phases."""
import json
from dataclasses import replace

import pytest

from meshserve.config import EngineConfig
from meshserve.engine.llm_engine import LLMEngine
from meshserve.engine.step_timeline import PHASES
from meshserve.sampling_params import SamplingParams


def test_each_step_is_traced_with_its_shape_and_phases(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
           "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    trace = tmp_path / "steps.jsonl"
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy", max_model_len=256,
                                    max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20,
                                    step_trace=str(trace)))
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(10, 20)), greedy)       # 10 prompt tokens
    engine.step()
    engine.add_request("b", list(range(30, 50)), greedy)       # 20: a chunk of 15, then 5
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    shapes = [(r["prompt_tokens"], r["prompts"], r["decodes"], r["context"]) for r in lines]
    assert shapes == [(10, 1, 0, 10),       # a's prompt
                      (15, 1, 1, 11 + 15),  # a decodes (context 11), b's first chunk fills the budget
                      (5, 1, 1, 12 + 20),   # a's last token, b's rest
                      (0, 0, 1, 21),        # b decodes
                      (0, 0, 1, 22)]
    assert all(set(PHASES) - {"ipc"} <= set(r) and r["forward"] > 0 for r in lines)
    assert [r["t"] for r in lines] == sorted(r["t"] for r in lines)
    assert engine.timeline.steps == len(lines)



def test_a_cpu_server_caps_the_prompt_tokens_joining_running_decodes_at_256(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 1024,
           "max_position_embeddings": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    def prompt_chunks(config: EngineConfig) -> list[int]:
        trace = tmp_path / "steps.jsonl"
        trace.unlink(missing_ok=True)
        engine = LLMEngine(replace(config, step_trace=str(trace)))
        running = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        engine.add_request("running", list(range(10, 20)), running)
        engine.step()
        long = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        engine.add_request("long", list(range(100, 700)), long)
        while engine.has_unfinished_requests():
            engine.step()
        engine.shutdown()
        return [r["prompt_tokens"] for r in map(json.loads, trace.read_text().splitlines())][1:4]

    offline = EngineConfig(model=str(tmp_path / "config.json"), load_format="dummy", max_model_len=1024,
                           kv_cache_memory_bytes=4 << 20, device="cpu")
    assert prompt_chunks(offline) == [600, 0, 0]                       # an offline engine: no cap
    assert offline.serving_defaults().prefill_chunk_with_decodes == 256
    assert prompt_chunks(offline.serving_defaults()) == [256, 256, 88]
    unset = replace(offline, prefill_chunk_with_decodes=0)              # 0: no cap, also when served
    assert prompt_chunks(unset.serving_defaults()) == [600, 0, 0]
    assert prompt_chunks(replace(offline, prefill_chunk_with_decodes=400).serving_defaults()) == [400, 200, 0]
    with pytest.raises(ValueError, match=r"prefill_chunk_with_decodes must be >= 0 \(a token count"):
        EngineConfig(model="x", prefill_chunk_with_decodes=-1)
    for bad in (True, 2.5):
        with pytest.raises(ValueError, match="prefill_chunk_with_decodes must be an integer"):
            EngineConfig(model="x", prefill_chunk_with_decodes=bad)
