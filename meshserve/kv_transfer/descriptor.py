"""What the two legs of a hand-off tell each other, validated once where it enters.

`TransferDescriptor`: made by the decode engine when it reserves the destination blocks (decode
reserves first), carried by the gateway to the prefill engine. It names the request and attempt,
the model and tokenizer revision, the KV layout (layers, KV heads, head size, block size, dtype:
both sides must agree), the prompt blocks to send (those after what decode already caches), the
destination block ids, the byte count, where to send them, and until when decode holds them.

`TransferCommit`: the prefill engine's last message: the checksum over every byte it sent, its
parallel layout, and the first token it sampled. Decode answers it with an ack only after the
bytes are checked and written into its blocks; only then does prefill free its own.
"""
from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


class DescriptorError(ValueError):
    """A descriptor or commit that is malformed, or does not fit this engine (layout, model)."""


@dataclass(frozen=True)
class KVLayout:
    """How one block's K/V are laid out in a hand-off: (layers, 2, blocks, block_size, kv_heads,
    head_dim) of `kv_dtype`, whatever the TP x PP of either side."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str

    def block_bytes(self) -> int:
        item = torch.empty((), dtype=getattr(torch, self.kv_dtype)).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * item

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        if not isinstance(d, dict):
            raise DescriptorError("layout must be an object")
        try:
            layout = cls(_int(d, "num_layers", 1), _int(d, "num_kv_heads", 1), _int(d, "head_dim", 1),
                         _int(d, "block_size", 1), str(d["kv_dtype"]))
        except KeyError as exc:
            raise DescriptorError(f"layout lacks {exc.args[0]!r}") from None
        if layout.kv_dtype not in KV_DTYPES:
            raise DescriptorError(f"layout.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {layout.kv_dtype!r}")
        return layout


@dataclass(frozen=True)
class TransferDescriptor:
    transfer_id: str
    request_id: str
    attempt_id: str
    model: str
    revision: str  # the weights' revision: K/V of other weights must never be imported
    tokenizer: str  # the tokenizer's identity: the token ids must mean the same on both sides
    layout: KVLayout
    first_block: int  # the prompt's first block to send (decode caches those before it)
    num_blocks: int
    dst_block_ids: list[int]
    num_bytes: int
    address: str  # the decode engine's receiver
    transport: str
    lease_id: str
    lease_expires_at: float  # wall clock (time.time()): decode holds the blocks until then
    decode_parallel: dict[str, int] = field(default_factory=dict)  # {"tp": , "pp": }

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.layout.block_size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_tokens"] = self.num_tokens
        return d

    @classmethod
    def from_dict(cls, d: Any) -> TransferDescriptor:
        if not isinstance(d, dict):
            raise DescriptorError("kv_transfer_params must be an object")
        try:
            layout = KVLayout.from_dict(d["layout"])
            num_blocks = _int(d, "num_blocks", 1)
            dst = d["dst_block_ids"]
            if not isinstance(dst, list) or len(dst) != num_blocks or \
                    any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in dst):
                raise DescriptorError(f"dst_block_ids must be {num_blocks} block ids")
            desc = cls(
                str(d["transfer_id"]), str(d.get("request_id", "")), str(d.get("attempt_id", "")), str(d["model"]),
                str(d["revision"]), str(d["tokenizer"]), layout, _int(d, "first_block", 0), num_blocks, list(dst),
                _int(d, "num_bytes", 1), str(d["address"]), str(d["transport"]), str(d.get("lease_id", "")),
                float(d["lease_expires_at"]),
                {str(k): int(v) for k, v in (d.get("decode_parallel") or {}).items()})
        except KeyError as exc:
            raise DescriptorError(f"kv_transfer_params lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, DescriptorError):
                raise
            raise DescriptorError(f"kv_transfer_params is malformed: {exc}") from None
        if not desc.transfer_id:
            raise DescriptorError("transfer_id must not be empty")
        if desc.num_bytes != desc.num_blocks * layout.block_bytes():
            raise DescriptorError(f"num_bytes ({desc.num_bytes}) does not match {num_blocks} blocks of this layout")
        return desc


@dataclass(frozen=True)
class TransferCommit:
    checksum: int  # crc32 over the chunks' bytes, in block order
    num_bytes: int
    first_token: int
    prefill_parallel: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> TransferCommit:
        if not isinstance(d, dict):
            raise DescriptorError("commit must be an object")
        try:
            return cls(_int(d, "checksum", 0), _int(d, "num_bytes", 0), _int(d, "first_token", 0),
                       {str(k): int(v) for k, v in (d.get("prefill_parallel") or {}).items()})
        except KeyError as exc:
            raise DescriptorError(f"commit lacks {exc.args[0]!r}") from None


def check_compatible(desc: TransferDescriptor, layout: KVLayout, model_revision: str, tokenizer: str) -> None:
    """DescriptorError unless the K/V this engine computes can be written where `desc` says."""
    if desc.layout != layout:
        raise DescriptorError(f"the KV layouts differ: the decode engine's {desc.layout}, this engine's {layout}")
    if desc.revision != model_revision:
        raise DescriptorError(f"the model revisions differ ({desc.revision!r} against {model_revision!r})")
    if desc.tokenizer != tokenizer:
        raise DescriptorError("the tokenizers differ: token ids would not mean the same on both sides")


def chunk_checksum(payload: torch.Tensor, running: int = 0) -> int:
    """crc32 of a chunk's bytes, continuing `running` (chunks are summed in block order)."""
    flat = payload.contiguous().view(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy().data, running)


def _int(d: dict, key: str, lo: int) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise DescriptorError(f"{key} must be an integer >= {lo}, got {v!r}")
    return v
