"""Units and data types.

Sizes are kept in bytes internally. Two unit families are shown to users and never mixed:
decimal GB (1e9 bytes; link and memory *bandwidths* and datasheet "GB" are decimal) and binary
GiB (2**30 bytes; what `nvidia-smi` and allocators report as capacity). 145.4 GB = 135.41 GiB.

Weight dtypes: the float ones (fp32, bf16, fp16); the engine's quantized formats, whose bytes come
from its one table of block formats (meshserve/block_formats.py): `int8` and `fp8` (one byte per
value plus one float32 scale per output row, as `--quantization int8|fp8` stores them) and the GGUF
block types `q4_0 ... q6_k` (bytes per value = block bytes / block values, the blocks' own scales
included); and `int4`, a generic 4-bit format the engine does not load, counted as the packed nibble
alone (0.5 bytes: group scales and zero points, about 3% at group size 128, are left out).
"""
from __future__ import annotations

from meshserve.block_formats import BLOCK_FORMATS, GGUF_BLOCK_TYPES, ROW_SCALE_BYTES, ROW_SCALED, BlockType
from meshserve.models.geometry import FP8_KV_CACHE_DTYPES, kv_element_bytes

GB = 1e9
GiB = float(2**30)
MiB = float(2**20)

FLOAT_DTYPES = ("fp32", "bf16", "fp16")
INT4_BYTES = 0.5  # the packed nibble only (see the module's docstring)

#: The engine's block format of each quantized weight dtype.
WEIGHT_BLOCK_TYPES: dict[str, BlockType] = {
    "int8": BlockType.INT8_ROWS, "fp8": BlockType.FP8_E4M3_ROWS,
    **{t.name.lower(): t for t in sorted(GGUF_BLOCK_TYPES)},
}
GGUF_DTYPES = tuple(name for name, t in WEIGHT_BLOCK_TYPES.items() if t in GGUF_BLOCK_TYPES)

#: Bytes per element of each weight / KV-cache data type (row scales aside: `weight_bytes`).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int4": INT4_BYTES,
    **{name: BLOCK_FORMATS[t].bytes / BLOCK_FORMATS[t].values for name, t in WEIGHT_BLOCK_TYPES.items()},
}

WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int8", "int4", "fp32", *GGUF_DTYPES)
# The engine's --kv-cache-dtype values (auto, fp8, fp8_e4m3, fp8_e5m2) and the 16/32-bit dtypes.
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", *FP8_KV_CACHE_DTYPES)


def dtype_bytes(dtype: str) -> float:
    """Bytes per value."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BYTES)}") from None


def check_weight_dtype(dtype: str, flag: str = "--weight-dtype") -> str:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{flag} {dtype!r} is not a weight dtype; valid: {', '.join(WEIGHT_DTYPES)}")
    return dtype


def row_scale_bytes(dtype: str) -> int:
    """Bytes each output row of a weight carries besides its values: a float32 scale for int8 and fp8."""
    block = WEIGHT_BLOCK_TYPES.get(dtype)
    return ROW_SCALE_BYTES if block in ROW_SCALED else 0


def weight_bytes(values: float, rows: float, dtype: str) -> float:
    """Bytes of weights holding `values` values in `rows` output rows in a dtype: the one rule for
    every weight byte the planner counts (row scales included)."""
    return values * dtype_bytes(dtype) + rows * row_scale_bytes(dtype)


def matrix_bytes(out_features: int, in_features: int, dtype: str) -> float:
    """Bytes of an [out_features, in_features] weight in a dtype: 576 x 1536 in q4_1 is
    576 x 1536 / 32 x 20 bytes; in int8 576 x 1536 + 576 x 4."""
    return weight_bytes(out_features * in_features, out_features, dtype)


def dtype_for_block_type(block_type: BlockType) -> str:
    """The planner's weight dtype for one of the engine's block formats (BlockType.Q4_1 -> "q4_1")."""
    return next(name for name, t in WEIGHT_BLOCK_TYPES.items() if t == block_type)


def resolve_compute_dtype(weight_dtype: str, cpu: bool = False) -> str:
    """The activations' dtype (norms, biases and the embeddings of int8/fp8 models are kept in it): a
    float weight dtype's own, else fp32 on a CPU (the engine's default there) and bf16 on a GPU."""
    check_weight_dtype(weight_dtype)
    if weight_dtype in FLOAT_DTYPES:
        return weight_dtype
    return "fp32" if cpu else "bf16"


def resolve_embedding_dtype(embedding_dtype: str | None, weight_dtype: str, compute_dtype: str) -> str:
    """The token embedding's and LM head's dtype: as given, else a GGUF file's own (the weight
    dtype: the planner's model of a file is one type throughout), else the compute dtype (the engine
    keeps them unquantized under int8/fp8, as vLLM does, and for int4)."""
    if embedding_dtype not in (None, "auto"):
        return check_weight_dtype(embedding_dtype, "--embedding-dtype")
    return weight_dtype if weight_dtype in GGUF_DTYPES else compute_dtype


def kv_dtype_bytes(kv_dtype: str) -> float:
    """Bytes per cached K or V element: the engine's rule (models/geometry.kv_element_bytes) for its
    fp8 values, the dtype's size for bf16 / fp16 / fp32."""
    if kv_dtype in FP8_KV_CACHE_DTYPES:
        return float(kv_element_bytes(kv_dtype, 0))
    if kv_dtype not in KV_DTYPES or kv_dtype == "auto":
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; valid: {', '.join(KV_DTYPES)}")
    return dtype_bytes(kv_dtype)


def resolve_kv_dtype(kv_dtype: str, weight_dtype: str, compute_dtype: str | None = None) -> str:
    """`auto` is the compute dtype (as the engine's --kv-cache-dtype auto): 16/32-bit weights' own,
    bf16 under quantized weights on a GPU."""
    if kv_dtype != "auto":
        kv_dtype_bytes(kv_dtype)
        return kv_dtype
    return compute_dtype or resolve_compute_dtype(weight_dtype)


def gib(n_bytes: float) -> float:
    return n_bytes / GiB


def gb(n_bytes: float) -> float:
    return n_bytes / GB
