"""What every attention backend provides, and the metadata fields they all share.

The runner packs a step's sequences into one flat token dimension, prefills (query length > 1)
first, then decodes (query length 1) (worker/step_packing.py). A backend turns that packed step
into the tensors its kernels read (`build_inputs`) and runs attention over them (`forward`). The
metadata it builds names the backend, so the model code calls attention without knowing which one
the runner chose.

The KV cache holds the compute dtype, or with --kv-cache-dtype fp8 one byte per element
(float8_e4m3fn or float8_e5m2). Each layer has vLLM's k_scale / v_scale (KVScales, held by the
layer's PagedAttention): an fp8 cache stores x / scale saturated to the format's range and is read
back as stored * scale. Every backend attends to K/V as the cache holds them, this step's new
tokens too, so a prompt computes the same whether its prefix was cached or not.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

import torch

# The fp8 formats of --kv-cache-dtype, with their largest finite value: stores saturate there.
FP8_KV_DTYPES: dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                                         "fp8_e5m2": torch.float8_e5m2}
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for a --kv-cache-dtype value: auto is the compute dtype."""
    if name == "auto":
        return compute_dtype
    try:
        return FP8_KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_KV_DTYPES)}, got {name!r}") from None


class KVScales(NamedTuple):
    """One layer's vLLM k_scale / v_scale: an fp8 cache stores x / scale and reads stored * scale.
    1.0 unless the checkpoint gives them; a cache in the compute dtype ignores them."""
    k: float = 1.0
    v: float = 1.0


UNIT_SCALES = KVScales()


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it: unchanged in the compute dtype; for fp8, x / scale in float32,
    saturated to the format's largest value (vLLM's stores saturate too), rounded to nearest."""
    if cache_dtype == x.dtype or cache_dtype not in FP8_MAX:
        return x.to(cache_dtype)
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return y.clamp(-FP8_MAX[cache_dtype], FP8_MAX[cache_dtype]).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values (a gathered copy) in the compute dtype: fp8 widened, times its scale in float32."""
    if x.dtype == dtype:
        return x
    return x.to(dtype) if scale == 1.0 else (x.float() * scale).to(dtype)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, KVH, D], already as the cache stores it (to_cache), into the flat slots of `cache`
    [num_blocks, block_size, KVH, D]. fp8 rows are copied as bytes: index_copy_ has no fp8 kernels."""
    kvh, d = x.shape[1], x.shape[2]
    if cache.dtype in FP8_MAX:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.view(-1, kvh, d).index_copy_(0, slots, x)


class PackedSpan(Protocol):
    q_start: int
    q_end: int
    num_cached: int
    block_table: list[int]


class PackedStep(Protocol):
    """What the builders read of worker/step_packing.PackedStep; the layers never import the worker."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    decode_context_lens: list[int]
    decode_block_tables: list[list[int]]

    @property  # read-only, so that a list of any PackedSpan type fits
    def prefills(self) -> Sequence[PackedSpan]: ...

    @property
    def num_prefill_tokens(self) -> int: ...


@dataclass(frozen=True)
class AttentionSpec:
    """The geometry the metadata builders need; every layer of a model shares it."""
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    block_size: int  # tokens per KV cache block

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(kw_only=True)
class AttentionMetadata:
    backend: AttentionBackend = field(repr=False, compare=False)  # the one that built it runs it
    slot_mapping: torch.Tensor  # [T] flat cache slot of every new token
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]; None in a step without decodes
    decode_context_lens: torch.Tensor | None = None  # [B] tokens each decode attends to, its own included


class ForwardInputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    metadata_type: ClassVar[type[AttentionMetadata]]

    def __init__(self, spec: AttentionSpec, device: torch.device):
        self.spec, self.device = spec, torch.device(device)

    @abstractmethod
    def build_inputs(self, packed: PackedStep) -> ForwardInputs:
        """Token ids, positions and this backend's metadata of a packed step, on the device.
        The ids and positions come from here too: a backend may send them in the same copy."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scales: KVScales = UNIT_SCALES) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D].

        All new K/V are written before any sequence attends: a sequence that shares a prefix block
        computed in the same step therefore reads it fully written. With an fp8 cache, k and v
        become what the cache holds (stored and read back) before any attention reads them."""
        kq, vq = to_cache(k, k_cache.dtype, scales.k), to_cache(v, v_cache.dtype, scales.v)
        write_kv(k_cache, meta.slot_mapping, kq)
        write_kv(v_cache, meta.slot_mapping, vq)
        if kq is not k:
            k, v = from_cache(kq, k.dtype, scales.k), from_cache(vq, v.dtype, scales.v)
        return self._attend(q, k, v, k_cache, v_cache, meta, scales)

    @abstractmethod
    def _attend(self, q, k, v, k_cache, v_cache, meta, scales: KVScales) -> torch.Tensor:
        """Attention of every new token, this step's K/V already in the caches (k, v: as stored)."""

    def decode_graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              context_lens: torch.Tensor) -> AttentionMetadata:
        """Metadata of a decode-only batch over persistent buffers, for a CUDA graph to capture:
        it must not depend on the step's values (context lengths, table widths), which each replay
        changes. Only backends with supports_cuda_graphs have it."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in a CUDA graph")


def padded_tables(tables: list[list[int]], fill: int = 0) -> tuple[list[list[int]], int]:
    """Block tables padded to one width (the widest), and that width."""
    width = max(len(t) for t in tables)
    return [t + [fill] * (width - len(t)) for t in tables], width
