"""Units and data types.

Sizes are kept in bytes internally. Two unit families are shown to users and never mixed:
decimal GB (1e9 bytes; link and memory *bandwidths* and datasheet "GB" are decimal) and binary
GiB (2**30 bytes; what `nvidia-smi` and allocators report as capacity). 145.4 GB = 135.41 GiB.
"""
from __future__ import annotations

GB = 1e9
GiB = float(2**30)
MiB = float(2**20)

#: Bytes per element of each weight / KV-cache data type. int4 counts the packed nibble only;
#: group scales and zero points (about 3% at group size 128) are left out.
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int4": 0.5}

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int4", "fp32")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "fp32")


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}") from None


def resolve_kv_dtype(kv_dtype: str, weight_dtype: str) -> str:
    """`auto` follows 16/32-bit weights and falls back to bf16 for fp8/int4 weights,
    as engines keep the cache in the activation dtype unless told otherwise."""
    if kv_dtype != "auto":
        dtype_bytes(kv_dtype)
        return kv_dtype
    return weight_dtype if weight_dtype in ("bf16", "fp16", "fp32") else "bf16"


def activation_bytes(weight_dtype: str) -> float:
    """Activations (what tensor/pipeline parallel collectives move) are 16-bit unless fp32."""
    return 4.0 if weight_dtype == "fp32" else 2.0


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


def gb(n_bytes: float) -> float:
    return n_bytes / GB
