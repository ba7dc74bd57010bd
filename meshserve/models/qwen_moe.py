"""Qwen2-MoE and Qwen3-MoE: softmax over the experts, top k, renormalised only when the config's
`norm_topk_prob` says so; Qwen2-MoE adds a shared expert scaled by a sigmoid gate; Qwen3-MoE has a
per-head query/key norm (no q/k/v bias) and no shared expert."""
from __future__ import annotations

from torch import nn

from meshserve.layers.moe import RouterSpec
from meshserve.models.llama import LlamaMLP
from meshserve.models.model_config import ModelConfig
from meshserve.models.moe_decoder import SparseMoeForCausalLM
from meshserve.models.registry import register_model


@register_model("Qwen3MoeForCausalLM", gguf="qwen3moe")
class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    def router_spec(self, cfg: ModelConfig) -> RouterSpec:
        return RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)


@register_model("Qwen2MoeForCausalLM", gguf="qwen2moe")
class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    def shared_expert(self, cfg: ModelConfig) -> nn.Module | None:
        if not cfg.shared_expert_intermediate_size:
            return None
        return LlamaMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, reduce_results=False)
