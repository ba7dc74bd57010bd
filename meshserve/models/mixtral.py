"""Mixtral: every layer sparse, softmax over the experts then top k, always renormalised; the expert
outputs are scaled by float32 weights. Checkpoints call the MoE module `block_sparse_moe` and the
expert projections w1 (gate), w3 (up) and w2 (down)."""
from __future__ import annotations

from meshserve.layers.moe import RouterSpec
from meshserve.models.model_config import ModelConfig
from meshserve.models.moe_decoder import SparseMoeForCausalLM
from meshserve.models.registry import register_model


@register_model("MixtralForCausalLM")
class MixtralForCausalLM(SparseMoeForCausalLM):
    MOE_MODULE = "block_sparse_moe"
    EXPERT_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}

    def router_spec(self, cfg: ModelConfig) -> RouterSpec:
        return RouterSpec(cfg.num_experts, cfg.num_experts_per_tok, renormalize=True, float32_weights=True)
