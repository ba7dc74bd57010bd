"""A tiny random-weight Llama (2 layers, 4 query heads over 2 KV heads) and a CPU ModelRunner of it,
for the tests of the GPU path's logic that run on CPU."""
from __future__ import annotations

import json
from pathlib import Path

from meshserve.config import EngineConfig
from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.models.loader import resolve_model
from meshserve.worker.model_runner import ModelRunner

TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 101,
               "max_position_embeddings": 256}


def write_tiny_config(directory: Path, **overrides) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**TINY_CONFIG, **overrides}))
    return path


def tiny_runner(directory: Path, max_model_len: int = 64, config: dict | None = None, dtype: str = "float32",
                **engine_args) -> ModelRunner:
    path = write_tiny_config(directory, **(config or {}))
    set_parallel_state(ParallelState())
    config = EngineConfig(model=str(path), load_format="dummy", dtype=dtype, device="cpu", **engine_args)
    return ModelRunner(config, resolve_model(str(path), "dummy"), max_model_len)
