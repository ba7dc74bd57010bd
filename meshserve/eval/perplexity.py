"""Teacher-forced perplexity of a model on a text, through the engine's own model runner: the text
goes in as prompt chunks of `chunk_tokens`, each attending to the K/V the earlier chunks cached (so
the KV cache's dtype counts, as it does when serving), and every position's logits score the next
token. One process, one rank.

    python -m meshserve.eval.perplexity FILE [--quantization gguf] [--kv-cache-dtype fp8] [model]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch

from meshserve.config import EngineConfig
from meshserve.distributed.parallel_state import ParallelState, set_parallel_state
from meshserve.models.loader import resolve_model
from meshserve.worker.model_runner import ModelRunner
from meshserve.worker.step import SeqStep, StepInput


def load_runner(config: EngineConfig, max_model_len: int) -> ModelRunner:
    """A single-rank runner of the config's model, its quantization resolved as the engine does."""
    if config.world_size != 1:
        raise ValueError("perplexity runs on one rank: tensor_parallel_size and pipeline_parallel_size 1")
    source = resolve_model(config.model, config.load_format)
    config = replace(config, quantization=source.quantization_for(config.quantization))
    set_parallel_state(ParallelState())
    return ModelRunner(config, source, max_model_len)


@torch.inference_mode()
def next_token_logprobs(runner: ModelRunner, token_ids: list[int], chunk_tokens: int = 64) -> torch.Tensor:
    """[n, vocab] float32: log p(. | token_ids[:i + 1]) at every position i."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    blocks = -(-len(token_ids) // runner.block_size)
    runner.init_kv_cache(blocks)
    table = list(range(blocks))
    out = []
    for start in range(0, len(token_ids), chunk_tokens):
        chunk = token_ids[start:start + chunk_tokens]
        hidden, _ = runner.forward(StepInput([SeqStep(0, chunk, start, table, sample=False)]))
        out.append(runner.model.compute_logits(hidden).float().log_softmax(-1))
    return torch.cat(out)


def token_logprobs(runner: ModelRunner, token_ids: list[int], chunk_tokens: int = 64) -> torch.Tensor:
    """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n-1, float32."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    logprobs = next_token_logprobs(runner, token_ids, chunk_tokens)[:-1]
    return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)


def top1_agreement(logprobs: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of positions where two models, given the same prefix, pick the same most likely
    next token: how often a greedy continuation of one is the other's, step by step (llama.cpp's
    KL-divergence statistics call it "same top")."""
    return (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item()


def greedy_agreement(runner: ModelRunner, token_ids: list[int], start: int, chunk_tokens: int = 64) -> float:
    """top1_agreement with a text that is itself a greedy continuation from `start` (of another
    model, or of another engine configuration): how often the runner's next token is the text's."""
    logprobs = next_token_logprobs(runner, token_ids, chunk_tokens)[start - 1:-1]
    return (logprobs.argmax(-1) == torch.tensor(token_ids[start:])).float().mean().item()


def perplexity_of(logprobs: torch.Tensor, token_ids: list[int]) -> float:
    """Perplexity of `token_ids` under next_token_logprobs' output for them."""
    scores = logprobs[:-1].gather(1, torch.tensor(token_ids[1:])[:, None])
    return math.exp(-scores.mean().item())


def perplexity(runner: ModelRunner, token_ids: list[int], chunk_tokens: int = 64) -> float:
    return math.exp(-token_logprobs(runner, token_ids, chunk_tokens).mean().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshserve.eval.perplexity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("text", type=Path, help="a UTF-8 text file")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    EngineConfig.add_cli_args(ap)
    args = ap.parse_args(argv)
    config = EngineConfig.from_cli_args(args)
    ids = resolve_model(config.model, config.load_format).load_tokenizer().encode(args.text.read_text())
    runner = load_runner(config, len(ids))
    print(f"perplexity {perplexity(runner, ids, args.chunk_tokens):.4f} over {len(ids)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
