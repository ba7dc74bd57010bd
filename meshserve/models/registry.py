"""Which model class serves which architecture.

A model family is one module in `meshserve/models/` that decorates its class with
`@register_model("HFArchitectureName", ..., gguf="gguf_arch")`. The class is a LlamaForCausalLM
(models/llama.py) or a subclass: the runner drives every family through that interface. The registry
imports every module of the package once, on first lookup, so adding a family touches no other file.
`config.json`'s `architectures[0]` (or a GGUF file's `general.architecture`) selects the class.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # llama registers itself here, so it is never imported from this module at run time
    from meshserve.models.llama import LlamaForCausalLM

_Family = TypeVar("_Family", bound="type[LlamaForCausalLM]")

_CLASSES: dict[str, type[LlamaForCausalLM]] = {}  # HF architecture name -> model class
_GGUF: dict[str, str] = {}  # GGUF general.architecture -> HF architecture name
# Modules of this package that define no model family.
_NOT_MODELS = frozenset({"registry", "model_config", "loader", "sharding", "moe_decoder"})
_discovered = False


def register_model(*architectures: str, gguf: str | None = None) -> Callable[[_Family], _Family]:
    """`gguf`: the GGUF `general.architecture` read as the first of `architectures`."""
    def wrap(cls: _Family) -> _Family:
        for arch in architectures:
            _CLASSES[arch] = cls
        if gguf is not None:
            _GGUF[gguf] = architectures[0]
        return cls
    return wrap


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    import meshserve.models as package
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _NOT_MODELS:
            importlib.import_module(f"{package.__name__}.{info.name}")
    _discovered = True


def check_supported(architecture: str) -> None:
    _discover()
    if architecture not in _CLASSES:
        raise ValueError(f"architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(sorted(_CLASSES))}")


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    check_supported(architecture)
    return _CLASSES[architecture]


def architecture_of_gguf(gguf_arch: str | None) -> str:
    """The HF architecture a GGUF file's `general.architecture` maps to."""
    _discover()
    if gguf_arch not in _GGUF:
        raise ValueError(f"GGUF architecture {gguf_arch!r} is not supported ({', '.join(sorted(_GGUF))})")
    return _GGUF[gguf_arch]
