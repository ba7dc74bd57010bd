"""The rules of a decoder's geometry that the engine (ModelConfig) and the planner (ModelSpec) share:
what makes a geometry valid, and how many bytes its KV cache takes (per element too, by
--kv-cache-dtype)."""
from __future__ import annotations

from meshserve.utils.checks import check_range


def check_geometry(where: str, *, hidden_size: int, num_layers: int, num_attention_heads: int, num_kv_heads: int,
                   vocab_size: int, head_dim: int, num_experts: int = 0, experts_per_token: int = 0) -> None:
    """ValueError naming the model (`where`) and the field that makes the geometry impossible."""
    for name, value in (("hidden_size", hidden_size), ("num_hidden_layers", num_layers),
                        ("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_kv_heads),
                        ("vocab_size", vocab_size), ("head_dim", head_dim)):
        check_range(f"{where}: {name}", value, 0, lo_open=True)
    if num_attention_heads % num_kv_heads:
        raise ValueError(f"{where}: num_attention_heads ({num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    if num_experts:
        check_range(f"{where}: num_experts_per_tok", experts_per_token, 1, num_experts)


def kv_entries_per_token(num_kv_heads: int, head_dim: int) -> int:
    """Cached elements per token and layer: a key and a value per KV head."""
    return 2 * num_kv_heads * head_dim


# The engine's --kv-cache-dtype values besides auto (the compute dtype): fp8, one byte per element.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def kv_element_bytes(kv_cache_dtype: str, compute_element_bytes: int) -> int:
    """Bytes of one cached key or value element for a --kv-cache-dtype value: 1 for fp8, else (auto)
    the compute dtype's."""
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return 1
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    return compute_element_bytes


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, element_bytes: int) -> int:
    """Bytes of one KV-cache block over `num_layers` layers (of one rank: its KV heads and layers)."""
    return num_layers * kv_entries_per_token(num_kv_heads, head_dim) * block_size * element_bytes
