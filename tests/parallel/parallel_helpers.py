"""Tiny random-weight Llama checkpoints (8 query heads) written with transformers, the prompts, and a
greedy generation helper shared by the parallel tests."""
from __future__ import annotations

from pathlib import Path

from meshserve import LLM, SamplingParams

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Small KV budget per rank: keeps start-up and memory low on a 2-core machine.
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)


def prompts() -> list:
    shared = list(range(100, 148))  # three full blocks shared by two prompts in the same step
    return [
        "Hello there, my friend",
        list(range(1000, 1041)),  # a long-ish prefill that pipeline micro-batches cut in pieces
        shared + [7, 8, 9],
        shared + [10, 11],
    ]


def make_tiny_model(path: Path, num_kv_heads: int, num_layers: int) -> Path:
    import torch
    import transformers

    from meshserve.models.loader import resolve_model

    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    resolve_model("default").load_tokenizer().save_hf(path)
    return path


def generate_ids(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, **ENGINE_ARGS, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]
    finally:
        llm.engine.shutdown()

