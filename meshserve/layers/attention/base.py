"""What every attention backend provides, and the metadata fields they all share.

The runner packs a step's sequences into one flat token dimension, prefills (query length > 1)
first, then decodes (query length 1) (worker/step_packing.py). A backend turns that packed step
into the tensors its kernels read (`build_inputs`) and runs attention over them (`forward`). The
metadata it builds names the backend, so the model code calls attention without knowing which one
the runner chose.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

import torch


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
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]. Returns [T, H, D].

        All new K/V are written before any sequence attends: a sequence that shares a prefix block
        computed in the same step therefore reads it fully written."""
        kvh, d = k.shape[1], k.shape[2]
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, k, v, k_cache, v_cache, meta)

    @abstractmethod
    def _attend(self, q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
        """Attention of every new token, this step's K/V already in the caches."""

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
