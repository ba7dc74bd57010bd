"""KV-cache blocks out of and into the ranks of a replica, in a form that does not depend on its TP/PP
layout: what the prefill -> decode hand-off moves between replicas that may be laid out differently.

The canonical form of n blocks is one CPU tensor `(L_total, 2, n, block_size, H_total, head_dim)` in
the KV dtype (fp8 stays fp8): every decoder layer, keys then values, the blocks in the order asked,
every KV head of the model. A rank holds a box of it: its pipeline stage's layers and its TP rank's
KV heads (with more TP ranks than KV heads several ranks hold the same head). On export each rank
gives a `KVPart` (its box, with where the box starts) and the executor `assemble`s them; on import
every rank receives the full tensor and copies its own box (`rank_slice`) into its cache blocks.
`KVLayout` is what must agree between the two sides for the blocks to mean the same thing.

Across process boundaries the tensors travel as raw bytes with their dtype and shape (`KVPart`'s
and `WireTensor`'s pickling): torch's own pickling of a float8 storage cannot be loaded back
(torch 2.13), and multiprocessing's reductions would put each tensor in shared memory behind a file
descriptor the receiving side has to fetch from the sender.
"""
from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshserve.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class KVLayout:
    """What a replica's KV blocks are made of; two replicas exchange blocks only when theirs are equal.
    (With an fp8 cache both sides must also read it with the same k/v scales, which holds when they
    load the same checkpoint.)"""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str  # torch's name without the "torch." prefix: "float32", "bfloat16", "float8_e4m3fn"

    def mismatch(self, other: KVLayout) -> str | None:
        """How `other` differs from this layout, or None when blocks can move between them."""
        diffs = [f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}" for f in fields(self)
                 if getattr(self, f.name) != getattr(other, f.name)]
        return "; ".join(diffs) or None

    @property
    def dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.kv_dtype)
        assert isinstance(dtype, torch.dtype), self.kv_dtype
        return dtype

    def full_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def check_full(self, block_ids: Sequence[int], full: torch.Tensor) -> None:
        """Raise ValueError unless `full` is the canonical tensor of `block_ids` for this layout."""
        want = self.full_shape(len(block_ids))
        if tuple(full.shape) != want or full.dtype != self.dtype:
            raise ValueError(f"KV blocks of shape {tuple(full.shape)} in {_dtype_name(full.dtype)} do not fit "
                             f"{len(block_ids)} blocks of this replica: {want} in {self.kv_dtype}")


# ---- the wire form ------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as one byte per element for the 1-byte float formats, whose index_copy_ CPU
    torch does not implement; other dtypes unchanged (a view, so writes reach the tensor)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def _to_wire(t: torch.Tensor, protocol: int) -> tuple[bytes | pickle.PickleBuffer, str, tuple[int, ...]]:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    # Protocol 5 (the executors' calls) writes the tensor's memory straight into the pickle and
    # loads it as a bytearray; older ones (multiprocessing's replies) need a bytes copy.
    raw = pickle.PickleBuffer(flat.data) if protocol >= 5 else flat.tobytes()
    return raw, _dtype_name(t.dtype), tuple(t.shape)


def _from_wire(raw: bytes | bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(raw, bytearray):  # a tensor over immutable memory would let a caller write into it
        raw = bytearray(raw)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).view(shape)


class WireTensor:
    """A CPU tensor that pickles as its raw bytes (see the module's docstring): the full tensor an
    executor sends to every rank on import."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce_ex__(self, protocol: int) -> tuple:  # type: ignore[override]
        return _wire_tensor, _to_wire(self.tensor, protocol)


def _wire_tensor(raw: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> WireTensor:
    return WireTensor(_from_wire(raw, dtype, shape))


def unwrap(full: torch.Tensor | WireTensor) -> torch.Tensor:
    return full.tensor if isinstance(full, WireTensor) else full


@dataclass(frozen=True)
class KVPart:
    """One rank's box of the canonical tensor: data is CPU, contiguous,
    `(L_local, 2, n, block_size, H_local, head_dim)`, covering layers [layer_start, + L_local) and KV
    heads [head_start, + H_local)."""
    layer_start: int
    head_start: int
    data: torch.Tensor

    def __reduce_ex__(self, protocol: int) -> tuple:  # type: ignore[override]
        return _kv_part, (self.layer_start, self.head_start, *_to_wire(self.data, protocol))

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_heads(self) -> int:
        return self.data.shape[4]


def _kv_part(layer_start: int, head_start: int, raw: bytes | bytearray, dtype: str, shape: tuple[int, ...]) -> KVPart:
    return KVPart(layer_start, head_start, _from_wire(raw, dtype, shape))


# ---- a rank's side ------------------------------------------------------------------------------
def kv_layout(runner: ModelRunner) -> KVLayout:
    cfg = runner.model.cfg
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, runner.head_dim, runner.block_size,
                    _dtype_name(runner.kv_dtype))


def kv_head_start(runner: ModelRunner) -> int:
    """The first of this rank's KV heads, by the rule its QKV projection loads them with: with fewer
    KV heads than TP ranks, `kv_replicas` consecutive ranks share one head."""
    qkv = runner.model.decoder_layers()[0].self_attn.qkv_proj
    return (qkv.tp_rank // qkv.kv_replicas) * qkv.num_kv_heads


def rank_slice(full: torch.Tensor, layer_start: int, num_layers: int, head_start: int,
               num_heads: int) -> torch.Tensor:
    """A rank's box of the canonical tensor (a view)."""
    return full[layer_start:layer_start + num_layers, :, :, :, head_start:head_start + num_heads]


def _block_index(runner: ModelRunner, block_ids: Sequence[int], distinct: bool) -> torch.Tensor:
    if not runner.kv_caches:
        raise RuntimeError("the KV cache is not allocated yet (init_kv_cache)")
    # With CUDA graphs the last block takes the padding rows' K/V (ModelRunner.init_kv_cache).
    usable = runner.kv_caches[0].shape[1] - (1 if runner.graph_sizes else 0)
    check_block_ids(block_ids, usable, distinct)
    return torch.tensor(list(block_ids), dtype=torch.long, device=runner.device)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, distinct: bool) -> None:
    """Raise ValueError for an id outside the cache, or (`distinct`: the ids written to) a repeated one,
    where index_copy_ would leave either source in the block."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"KV block ids {bad[:8]} are outside the cache's {num_blocks} blocks")
    if distinct and len(set(block_ids)) != len(block_ids):
        raise ValueError("KV block ids to import must be distinct")


@torch.no_grad()
def export_blocks(runner: ModelRunner, block_ids: Sequence[int]) -> KVPart:
    """This rank's box of the blocks `block_ids`, on the CPU."""
    idx = _block_index(runner, block_ids, distinct=False)
    caches = runner.kv_caches
    _, _, block_size, heads, head_dim = caches[0].shape
    out = torch.empty((len(caches), 2, len(block_ids), block_size, heads, head_dim), dtype=runner.kv_dtype)
    for layer, cache in enumerate(caches):
        if cache.device.type == "cpu":  # straight into the output, no intermediate copy
            torch.index_select(_as_bytes(cache), 1, idx, out=_as_bytes(out[layer]))
        else:
            _as_bytes(out[layer]).copy_(_as_bytes(cache).index_select(1, idx))
    return KVPart(runner.model.layer_range.start, kv_head_start(runner), out)


@torch.no_grad()
def import_blocks(runner: ModelRunner, block_ids: Sequence[int], full: torch.Tensor) -> None:
    """Copy this rank's box of the canonical tensor `full` into its cache blocks `block_ids`."""
    kv_layout(runner).check_full(block_ids, full)
    idx = _block_index(runner, block_ids, distinct=True)
    caches = runner.kv_caches
    mine = rank_slice(full, runner.model.layer_range.start, len(caches), kv_head_start(runner),
                      runner.num_kv_heads)
    for layer, cache in enumerate(caches):
        _as_bytes(cache).index_copy_(1, idx, _as_bytes(mine[layer]).to(cache.device))


# ---- the executor's side ------------------------------------------------------------------------
def assemble(parts: Sequence[KVPart], num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """The canonical tensor from every rank's part. Ranks that share a replicated KV head hold the
    same bytes for it (they compute it from the same all-reduced input), so a box placed already is
    skipped; any other overlap, or a gap, means the parts do not fit."""
    if not parts:
        raise ValueError("no KV parts to assemble")
    first = parts[0].data
    if (len(parts) == 1 and parts[0].layer_start == parts[0].head_start == 0
            and (first.shape[0], first.shape[4]) == (num_layers, num_kv_heads)):
        return first  # a single rank holds it all: it already is the canonical tensor
    _, _, n, block_size, _, head_dim = first.shape
    full = torch.empty((num_layers, 2, n, block_size, num_kv_heads, head_dim), dtype=first.dtype)
    covered = torch.zeros(num_layers, num_kv_heads, dtype=torch.bool)
    placed: set[tuple[int, int, int, int]] = set()
    for part in parts:
        data = part.data
        box = (part.layer_start, part.num_layers, part.head_start, part.num_heads)
        if (data.dtype != first.dtype or data.shape[1:4] != first.shape[1:4] or data.shape[5] != head_dim
                or part.layer_start + part.num_layers > num_layers or part.head_start + part.num_heads > num_kv_heads):
            raise ValueError(f"KV part {box} of shape {tuple(data.shape)} in {_dtype_name(data.dtype)} does not "
                             f"fit {num_layers} layers x {num_kv_heads} KV heads of {tuple(first.shape)} parts")
        if box in placed:
            continue
        seen = rank_slice(covered.view(num_layers, 1, 1, 1, num_kv_heads), *box)
        if bool(seen.any()):
            raise ValueError(f"KV part {box} overlaps another part")
        _as_bytes(rank_slice(full, *box)).copy_(_as_bytes(data))
        seen.fill_(True)
        placed.add(box)
    if not bool(covered.all()):
        missing = covered.logical_not().nonzero().tolist()
        raise ValueError(f"the KV parts leave (layer, head) {missing[:8]} uncovered")
    return full
