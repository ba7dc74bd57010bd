"""Tiny random-weight MoE checkpoints of each family written with transformers, the prompts, and greedy
generation with meshserve and with transformers' eager reference."""
from __future__ import annotations

from pathlib import Path

import torch

from meshserve import LLM, SamplingParams

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)
_COMMON = dict(vocab_size=49152, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
               max_position_embeddings=512)


def prompts() -> list[list[int]]:
    shared = list(range(100, 148))  # three full blocks shared by two prompts in the same step
    return [[5, 17, 300, 42, 7, 8, 9, 10], list(range(1000, 1041)), shared + [7, 8, 9], shared + [10, 11], [3]]


def family_config(family: str, vocab_size: int = 49152):
    """Each family's own quirks: Qwen3-MoE renormalised top-k with q/k norms; Qwen2-MoE a shared
    expert, q/k/v bias, no renormalisation and a dense layer between MoE layers; Mixtral 4 experts."""
    import transformers

    common = {**_COMMON, "vocab_size": vocab_size}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_hidden_layers=2, intermediate_size=64, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                           **common)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(num_hidden_layers=3, intermediate_size=64, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1], **common)
    if family == "mixtral":
        return transformers.MixtralConfig(num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                                          num_experts_per_tok=2, **common)
    raise ValueError(family)


def make_tiny_moe(path: Path, family: str, vocab_size: int = 49152):
    """Save a tiny model of `family` (weights ~N(0, 0.2) so greedy paths are not flat), with the
    embedded model's tokenizer when the vocabulary is its size; returns it."""
    import transformers

    from meshserve.models.loader import resolve_model

    cfg = family_config(family, vocab_size)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.eval().save_pretrained(path, safe_serialization=True)
    if vocab_size == 49152:
        resolve_model("default").load_tokenizer().save_hf(path)
    return model


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            # An explicit mask: generate() would otherwise take prompt tokens equal to pad_token_id for padding.
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


def run_greedy(model: str, prompt_ids: list[list[int]] | None = None, **kwargs) -> tuple[list[list[int]], dict, dict]:
    """(token ids per prompt, expert load snapshot, per-rank timing snapshot) of one engine run."""
    llm = LLM(model, **ENGINE_ARGS, **kwargs)
    try:
        ids = [o.outputs[0].token_ids for o in llm.generate(prompt_ids or prompts(), GREEDY)]
        stats = llm.engine.get_stats()
        return ids, stats.expert_load, stats.parallel_timing
    finally:
        llm.engine.shutdown()
