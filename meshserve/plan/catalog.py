"""Model and GPU catalogs, and lookup by name, Hugging Face `config.json`, or calibration."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from meshserve.models.model_config import ModelConfig

from .specs import GPUSpec, ModelSpec
from .units import GB, MiB


class _Geometry(TypedDict):
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


_LLAMA70 = _Geometry(num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
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
    ModelSpec("Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 6144, 151936, max_context=40960, num_params=30.53e9,
              num_experts=128, experts_per_token=8, moe_intermediate_size=768, hf_id="Qwen/Qwen3-30B-A3B"),
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
        from .calibration import load_calibration
        return load_calibration(calibration_file).to_gpu_spec()
    for gpu in GPUS.values():
        if gpu.name.lower() == name.lower():
            return gpu
    raise ValueError(f"unknown GPU {name!r}; valid: {', '.join(gpu_names())}")


def model_from_hf_config(cfg: dict[str, Any], name: str = "config.json") -> ModelSpec:
    """Geometry from a Hugging Face `config.json`, read by the engine's own parser (so the planner
    and the engine never disagree on a model). The parameter count is computed from the geometry."""
    return spec_from_model_config(ModelConfig.from_hf_config(cfg, name), name)


def spec_from_model_config(c: ModelConfig, name: str) -> ModelSpec:
    assert c.head_dim is not None, "ModelConfig.__post_init__ fills head_dim"
    shared = c.num_shared_experts or (
        c.shared_expert_intermediate_size // c.moe_intermediate_size if c.moe_intermediate_size else 0)
    return ModelSpec(
        name=name, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        max_context=c.max_position_embeddings, num_experts=c.num_experts,
        experts_per_token=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
        num_shared_experts=shared, first_dense_layers=c.first_dense_layers,
        kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim)
