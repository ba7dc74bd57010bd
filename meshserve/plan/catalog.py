"""Model and GPU catalogs, and lookup by name, Hugging Face `config.json`, or calibration."""
from __future__ import annotations

import json
from pathlib import Path

from .specs import GPUSpec, ModelSpec
from .units import GB, MiB

_LLAMA70 = dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                head_dim=128, intermediate_size=28672, vocab_size=128256)

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, max_context=131072,
              num_params=8.03e9, hf_id="meta-llama/Llama-3.1-8B-Instruct"),
    ModelSpec("Llama-3-70B", **_LLAMA70, max_context=8192, num_params=70.55e9,
              hf_id="meta-llama/Meta-Llama-3-70B-Instruct"),
    ModelSpec("Llama-3.1-70B", **_LLAMA70, max_context=131072, num_params=70.55e9,
              hf_id="meta-llama/Llama-3.1-70B-Instruct"),
    ModelSpec("Llama-3.3-70B", **_LLAMA70, max_context=131072, num_params=70.55e9,
              hf_id="meta-llama/Llama-3.3-70B-Instruct"),
    ModelSpec("Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256, max_context=131072,
              num_params=405.85e9, hf_id="meta-llama/Llama-3.1-405B-Instruct"),
    ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, attention_bias=True,
              max_context=32768, num_params=7.62e9, hf_id="Qwen/Qwen2.5-7B-Instruct"),
    ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, attention_bias=True,
              max_context=32768, num_params=72.7e9, hf_id="Qwen/Qwen2.5-72B-Instruct"),
    ModelSpec("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32768, max_context=32768,
              num_params=7.25e9, hf_id="mistralai/Mistral-7B-Instruct-v0.3"),
    ModelSpec("Mixtral-8x7B", 32, 4096, 32, 8, 128, 14336, 32000, max_context=32768,
              num_params=46.7e9, num_experts=8, experts_per_token=2, moe_intermediate_size=14336,
              hf_id="mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ModelSpec("DeepSeek-V3", 61, 7168, 128, 128, 192, 18432, 129280, max_context=163840,
              num_params=671e9, num_experts=256, experts_per_token=8, moe_intermediate_size=2048,
              num_shared_experts=1, first_dense_layers=3, kv_lora_rank=512, q_lora_rank=1536,
              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              hf_id="deepseek-ai/DeepSeek-V3",
              notes="MoE + MLA; published weights are block-scaled fp8 (use --weight-dtype fp8); "
                    "671B excludes the 14B multi-token-prediction module"),
    ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True,
              max_context=8192, num_params=134_515_008,
              hf_id="HuggingFaceTB/SmolLM2-135M-Instruct", notes="the embedded default model"),
)}

# Datasheet figures (dense, no sparsity). memory_bytes is nvidia-smi's memory.total; link
# bandwidths are per GPU per direction: NVLink3 300 GB/s, NVLink4 450, NVLink5 900, PCIe Gen5
# x16 ~64, Gen4 ~32; inter-node is one NIC per GPU (HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50).
GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    GPUSpec("A100-40GB", 40960 * MiB, 1555 * GB, 312e12, None, 156e12, 300 * GB, 25 * GB,
            notes="SXM4; no fp8 units: fp8 weights are weight-only, computed in bf16"),
    GPUSpec("A100-80GB", 81920 * MiB, 2039 * GB, 312e12, None, 156e12, 300 * GB, 25 * GB,
            notes="SXM4; no fp8 units"),
    GPUSpec("H100-SXM", 81559 * MiB, 3350 * GB, 989.4e12, 1978.9e12, 494.7e12, 450 * GB, 50 * GB),
    GPUSpec("H100-PCIe", 81559 * MiB, 2000 * GB, 756e12, 1513e12, 378e12, 64 * GB, 25 * GB,
            intra_node_latency_s=3e-6, notes="links over PCIe Gen5 (no NVLink bridge assumed)"),
    GPUSpec("H200", 143771 * MiB, 4800 * GB, 989.4e12, 1978.9e12, 494.7e12, 450 * GB, 50 * GB),
    GPUSpec("L40S", 46068 * MiB, 864 * GB, 362.05e12, 733e12, 183e12, 32 * GB, 25 * GB,
            intra_node_latency_s=3e-6, notes="GDDR6, no NVLink: links over PCIe Gen4"),
    GPUSpec("B200", 183359 * MiB, 8000 * GB, 2250e12, 4500e12, 1125e12, 900 * GB, 50 * GB),
)}

THIS_MACHINE = "this-machine"


def model_names() -> list[str]:
    return list(MODELS)


def gpu_names() -> list[str]:
    return [*GPUS, THIS_MACHINE]


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog name (case-insensitive; the Hugging Face id works too), a `config.json`, or a
    directory holding one."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return model_from_hf_config(json.loads(path.read_text()), name=str(name_or_path))
    key = name_or_path.lower()
    for spec in MODELS.values():
        if key in (spec.name.lower(), spec.hf_id.lower()):
            return spec
    raise ValueError(f"unknown model {name_or_path!r}: not a config.json or a directory with one, "
                     f"and not in the catalog ({', '.join(MODELS)})")


def get_gpu(name: str, calibration_file: str | Path | None = None) -> GPUSpec:
    """A catalog GPU, or `this-machine` built from the cached calibration."""
    if name.lower() == THIS_MACHINE:
        from .calibrate import (
            load_calibration,  # torch stays unimported until measuring
        )
        return load_calibration(calibration_file).to_gpu_spec()
    for gpu in GPUS.values():
        if gpu.name.lower() == name.lower():
            return gpu
    raise ValueError(f"unknown GPU {name!r}; valid: {', '.join(gpu_names())}")


def _first(cfg: dict, *keys: str, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def model_from_hf_config(cfg: dict, name: str = "config.json") -> ModelSpec:
    """Geometry from a Hugging Face `config.json` (Llama, Qwen2, Mistral, Mixtral, Qwen-MoE,
    DeepSeek-V2/V3 key names). The parameter count is computed from the geometry."""
    cfg = cfg.get("text_config") or cfg  # multimodal configs nest the language model

    def need(*keys: str):
        value = _first(cfg, *keys)
        if value is None:
            raise ValueError(f"{name}: missing {' or '.join(keys)}")
        return value

    hidden = int(need("hidden_size", "n_embd", "d_model"))
    heads = int(need("num_attention_heads", "n_head"))
    experts = int(_first(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=0))
    moe_inter = int(_first(cfg, "moe_intermediate_size", default=0)) or (
        int(need("intermediate_size")) if experts else 0)
    shared = _first(cfg, "n_shared_experts", default=0)
    if not shared and cfg.get("shared_expert_intermediate_size") and moe_inter:
        shared = cfg["shared_expert_intermediate_size"] // moe_inter
    model_type = str(cfg.get("model_type", ""))
    return ModelSpec(
        name=name,
        num_layers=int(need("num_hidden_layers", "n_layer", "num_layers")),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_first(cfg, "head_dim", default=hidden // heads)),
        intermediate_size=int(_first(cfg, "intermediate_size", "n_inner", default=4 * hidden)),
        vocab_size=int(need("vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type.startswith("qwen2"))),
        max_context=int(_first(cfg, "max_position_embeddings", default=8192)),
        num_experts=experts,
        experts_per_token=int(_first(cfg, "num_experts_per_tok", default=0)) if experts else 0,
        moe_intermediate_size=moe_inter,
        num_shared_experts=int(shared or 0),
        first_dense_layers=int(_first(cfg, "first_k_dense_replace", default=0)),
        kv_lora_rank=int(_first(cfg, "kv_lora_rank", default=0)),
        q_lora_rank=int(_first(cfg, "q_lora_rank", default=0)),
        qk_rope_head_dim=int(_first(cfg, "qk_rope_head_dim", default=0)),
        qk_nope_head_dim=int(_first(cfg, "qk_nope_head_dim", default=0)),
        v_head_dim=int(_first(cfg, "v_head_dim", default=0)),
    )
