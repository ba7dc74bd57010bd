"""The `weight_loader` each sharded parameter carries: a callable `(param, full_tensor[, shard_id])`
that copies this rank's slice of a whole checkpoint tensor into the parameter (layers/linear.py).

The layer that owns a parameter attaches it at construction (`set_weight_loader`) and the model's
`load_weights` reads it back (`weight_loader`). A parameter without one takes the tensor as it is.
The shard id's type is the layer's own (a "q"/"k"/"v" letter, a gate/up index, an (expert, which)
pair), so a loader is typed by its first two arguments only.

A loaded tensor may also be a `QuantizedWeight` (a GGUF file's blocks, read as stored): its slices
are taken the same way (`narrow` on rows, or on whole blocks of a row) and `store_rows` keeps them on
the parameter until the model is loaded, when quantization/assemble.py joins them into the layer's
quantized matmul.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshserve.layers.quantization.blocks import QuantizedWeight

WeightLoader = Callable[..., None]  # (param, loaded[, shard_id]) -> None
Loaded = torch.Tensor | QuantizedWeight

_ATTR = "weight_loader"
_PIECES = "quantized_pieces"


def plain_loader(param: nn.Parameter, loaded: Loaded) -> None:
    """The whole tensor, unsplit (a replicated parameter)."""
    store_rows(param, loaded)


def store_rows(param: nn.Parameter, piece: Loaded, offset: int = 0) -> None:
    """Rows [offset, offset + len(piece)) of the parameter are `piece`: copied, or for quantized
    blocks kept as they are until the layer assembles them."""
    if isinstance(piece, QuantizedWeight):
        quantized_pieces(param).append((offset, piece))
    else:
        param.data.narrow(0, offset, piece.shape[0]).copy_(piece)


def quantized_pieces(param: nn.Parameter) -> list[tuple[int, QuantizedWeight]]:
    """The (first row, blocks) pieces loaded into the parameter so far."""
    pieces = getattr(param, _PIECES, None)
    if pieces is None:
        pieces = []
        setattr(param, _PIECES, pieces)
    return pieces


def take_quantized_pieces(param: nn.Parameter) -> list[tuple[int, QuantizedWeight]]:
    """The pieces, sorted by row, forgotten by the parameter."""
    pieces = getattr(param, _PIECES, [])
    if hasattr(param, _PIECES):
        delattr(param, _PIECES)
    return sorted(pieces, key=lambda p: p[0])


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    # A plain attribute on the tensor object: torch's stubs declare none, hence setattr.
    setattr(param, _ATTR, loader)


def weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or a plain copy for one without."""
    loader: WeightLoader = getattr(param, _ATTR, plain_loader)
    return loader
