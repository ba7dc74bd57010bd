"""The `weight_loader` each sharded parameter carries: a callable `(param, full_tensor[, shard_id])`
that copies this rank's slice of a whole checkpoint tensor into the parameter (layers/linear.py).

The layer that owns a parameter attaches it at construction (`set_weight_loader`) and the model's
`load_weights` reads it back (`weight_loader`). A parameter without one takes the tensor as it is.
The shard id's type is the layer's own (a "q"/"k"/"v" letter, a gate/up index, an (expert, which)
pair), so a loader is typed by its first two arguments only.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WeightLoader = Callable[..., None]  # (param, loaded[, shard_id]) -> None

_ATTR = "weight_loader"


def plain_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """The whole tensor, unsplit (a replicated parameter)."""
    param.data.copy_(loaded)


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    # A plain attribute on the tensor object: torch's stubs declare none, hence setattr.
    setattr(param, _ATTR, loader)


def weight_loader(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or a plain copy for one without."""
    loader: WeightLoader = getattr(param, _ATTR, plain_loader)
    return loader
