"""ModelConfig: a decoder's geometry, read from a HF config.json or GGUF metadata.

This is the one parser of `config.json`: the engine builds models from it and the planner sizes
deployments from it (`plan/catalog.py` turns it into a ModelSpec). It reads the key names of the
Llama, Qwen2, Mistral, Mixtral, Qwen2/3-MoE and DeepSeek-V2/V3 families, including fields the
engine cannot run yet (latent attention): which architectures the engine serves is the model
registry's business (`models/registry.py`), not the parser's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshserve.models.geometry import check_geometry


@dataclass
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before the rotary embedding
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    model_type: str = ""
    # Mixture of experts: routed experts replace the dense MLP in the MoE layers.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one shared expert with a sigmoid gate
    num_shared_experts: int = 0  # DeepSeek: shared experts of moe_intermediate_size each
    first_dense_layers: int = 0  # leading layers that keep a dense MLP
    decoder_sparse_step: int = 1  # Qwen-MoE: every k-th layer is sparse
    mlp_only_layers: list[int] = field(default_factory=list)  # Qwen-MoE: layers forced dense
    # Multi-head latent attention (DeepSeek-V2/V3), parsed for the planner; not served.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])
        check_geometry(self.architecture, hidden_size=self.hidden_size, num_layers=self.num_hidden_layers,
                       num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads,
                       vocab_size=self.vocab_size, head_dim=self.head_dim, num_experts=self.num_experts,
                       experts_per_token=self.num_experts_per_tok)

    # ---- geometry ----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (self.is_moe and layer >= self.first_dense_layers and layer not in self.mlp_only_layers
                and (layer + 1) % max(1, self.decoder_sparse_step) == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # ---- config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "config.json") -> ModelConfig:
        cfg = cfg.get("text_config") or cfg  # multimodal configs nest the language model

        def first(*keys: str, default=None):
            for k in keys:
                if cfg.get(k) is not None:
                    return cfg[k]
            return default

        def need(*keys: str):
            value = first(*keys)
            if value is None:
                raise ValueError(f"{name}: missing {' or '.join(keys)}")
            return value

        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = str(cfg.get("model_type", ""))
        hidden = int(need("hidden_size", "n_embd", "d_model"))
        heads = int(need("num_attention_heads", "n_head"))
        experts = int(first("num_local_experts", "n_routed_experts", "num_experts", default=0))
        # Newer configs put rope_theta and the scaling into one "rope_parameters" dict.
        rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(need("num_hidden_layers", "n_layer", "num_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(first("num_key_value_heads", default=heads)),
            intermediate_size=int(first("intermediate_size", "n_inner", default=4 * hidden)),
            vocab_size=int(need("vocab_size")),
            head_dim=first("head_dim"),
            rms_norm_eps=float(first("rms_norm_eps", default=1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(first("max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(first("attention_bias", "qkv_bias",
                                      default=model_type.startswith("qwen2") or arch.startswith("Qwen2"))),
            qk_norm=model_type.startswith("qwen3") or arch.startswith("Qwen3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id") or [],
            architecture=arch,
            model_type=model_type,
            num_experts=experts,
            num_experts_per_tok=int(first("num_experts_per_tok", default=0)) if experts else 0,
            moe_intermediate_size=int(first("moe_intermediate_size", default=0))
            or (int(first("intermediate_size", default=0)) if experts else 0),
            norm_topk_prob=bool(first("norm_topk_prob", default=model_type == "mixtral")),
            shared_expert_intermediate_size=int(first("shared_expert_intermediate_size", default=0)),
            num_shared_experts=int(first("n_shared_experts", default=0)),
            first_dense_layers=int(first("first_k_dense_replace", default=0)),
            decoder_sparse_step=int(first("decoder_sparse_step", default=1)),
            mlp_only_layers=list(first("mlp_only_layers", default=[])),
            kv_lora_rank=int(first("kv_lora_rank", default=0)),
            q_lora_rank=int(first("q_lora_rank", default=0)),
            qk_rope_head_dim=int(first("qk_rope_head_dim", default=0)),
            qk_nope_head_dim=int(first("qk_nope_head_dim", default=0)),
            v_head_dim=int(first("v_head_dim", default=0)),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_config(json.loads(Path(path).read_text()), name=str(path))

    def to_hf_config(self) -> dict:
        """A config.json that `transformers` accepts for the same geometry (dense and MoE families)."""
        model_type = self.model_type or _MODEL_TYPES.get(self.architecture, "llama")
        out = {
            "architectures": [self.architecture], "model_type": model_type,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.is_moe:
            out.update(self._hf_moe_fields(model_type))
        return out

    def _hf_moe_fields(self, model_type: str) -> dict:
        if model_type == "mixtral":  # every layer sparse, experts as wide as intermediate_size
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "intermediate_size": self.moe_intermediate_size}
        out = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
               "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
               "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}
        if model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            out["qkv_bias"] = self.attention_bias
        else:
            out["attention_bias"] = self.attention_bias
        return out


# HF architecture -> config.json model_type, for configs written from a ModelConfig.
_MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
