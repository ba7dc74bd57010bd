"""What the sparse MoE families share: a Llama-family decoder whose MoE layers hold a SparseMoeBlock
(layers/moe.py) instead of the dense MLP, the checkpoint names of the experts, and the recorder of
how many tokens each expert received (the skew instruments, distributed/expert_load.py).

A family subclass says how its router behaves (`router_spec`), whether its MoE layers have a shared
expert, and what its checkpoints call the MoE module and the expert projections.
"""
from __future__ import annotations

import re

from torch import nn

from meshserve.distributed.expert_load import ExpertLoadRecorder
from meshserve.layers.moe import RouterSpec, SparseMoeBlock
from meshserve.layers.rotary import RotaryEmbedding
from meshserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from meshserve.models.model_config import ModelConfig


class SparseMoeForCausalLM(LlamaForCausalLM):
    MOE_MODULE = "mlp"  # the checkpoint's name for a layer's router + experts
    EXPERT_PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, cfg: ModelConfig, pp_split: list[int] | None = None):
        super().__init__(cfg, pp_split)
        blocks = {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(layer.mlp, SparseMoeBlock)}
        self.expert_load = ExpertLoadRecorder(sorted(blocks), cfg.num_experts)
        for i, block in blocks.items():
            block.layer, block.recorder = i, self.expert_load
        self._expert_name = re.compile(rf"layers\.(\d+)\.{self.MOE_MODULE}\.experts\.(\d+)\.(\w+)\.weight$")

    def router_spec(self, cfg: ModelConfig) -> RouterSpec:
        raise NotImplementedError

    def shared_expert(self, cfg: ModelConfig) -> nn.Module | None:
        """A module returning its TP partial sum (the MoE block reduces it), or None."""
        return None

    def make_layer(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> LlamaDecoderLayer:
        if not cfg.is_moe_layer(layer):
            return super().make_layer(cfg, layer, rotary)
        block = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, self.router_spec(cfg),
                               self.shared_expert(cfg))
        return LlamaDecoderLayer(cfg, rotary, mlp=block)

    def checkpoint_target(self, local: str) -> tuple[str, object]:
        m = self._expert_name.match(local)
        if m:
            layer, expert, projection = m.groups()
            which = self.EXPERT_PROJECTIONS[projection]
            return f"layers.{layer}.mlp.experts.{'w2' if which == 'down' else 'w13'}", (int(expert), which)
        return super().checkpoint_target(local.replace(f".{self.MOE_MODULE}.", ".mlp."))
