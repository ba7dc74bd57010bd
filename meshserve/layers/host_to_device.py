"""Host lists to device tensors without stalling the GPU queue.

`torch.tensor(values, device="cuda")` copies from pageable memory, and CUDA performs such a copy
only after the stream has drained: a host sync per call. On CUDA these helpers stage the values
in pinned memory and copy them with non_blocking=True (the caching host allocator keeps the
staging buffer alive until the copy has run); several arrays travel in one copy. On CPU they are
plain `torch.tensor` calls, as before.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One (possibly nested) list as a tensor on `device`."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def arrays_to_device(arrays: Sequence[Sequence], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat lists as 1-D tensors on `device`; on CUDA all of them through a single copy."""
    if device.type != "cuda":
        return [torch.tensor(a, dtype=dtype) for a in arrays]
    flat = torch.tensor(list(chain.from_iterable(arrays)), dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return list(flat.split([len(a) for a in arrays]))
