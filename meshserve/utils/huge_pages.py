"""Host memory on transparent huge pages (Linux), for what CPU decode streams from memory every step:
the weights and the KV cache.

A batch-1 decode step reads every weight once. On 4 KiB pages that stream takes a TLB miss every 4
KiB (a two-dimensional page walk under a hypervisor) and the hardware prefetcher starts over at
each page; each linear layer, a separate allocation, is also a stream of its own. With THP in
`madvise` mode (the common default) memory gets huge pages only where it asks, and PyTorch's CPU
allocator does not ask (its THP_MEM_ALLOC_ENABLE is read once, at torch's first allocation, and
covers allocations of 2 MiB and more only). `Arena` asks for one block and lays tensors out in it
back to back, in the order the step reads them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>
_ALIGN = 64  # every tensor starts on a cache line
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str:
    """The kernel's THP setting ("always", "madvise", "never"), or "" where there is none."""
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return ""
    return next((w[1:-1] for w in text.split() if w.startswith("[")), "")


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def empty(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(nbytes of untouched uint8 host memory starting on a huge page, whether the kernel was asked
    to back it with huge pages when it is first written)."""
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES  # the advice covers whole huge pages
    block = torch.empty(length + HUGE_PAGE_BYTES, dtype=torch.uint8)  # room to start on one
    start = -block.data_ptr() % HUGE_PAGE_BYTES
    out = block[start:start + nbytes]
    madvise = _madvise()
    if madvise is None or thp_mode() not in ("always", "madvise"):
        return out, False
    if madvise(out.data_ptr(), length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return out, False
    return out, True


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on huge pages where the kernel offers them (see `empty`). Its last huge
    page is resident whole once written. The first touch of fresh huge pages can wait on the kernel
    compacting memory (4 GiB took 3.8 s where plain pages took 1.1 s, and 0.3 s a second time)."""
    block, _ = empty(math.prod(shape) * dtype.itemsize)
    return block.view(dtype).view(shape).zero_()


class Arena:
    """Tensors moved one at a time into one block from `empty`, in the order given to the
    constructor; a storage seen twice (a tied weight) takes one place. Each `move` copies its tensor
    in and returns the copy, so that the caller drops the original before the next: the process
    never holds more than one tensor twice."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.offsets: dict[tuple[int, int], int] = {}
        total = 0
        for t in tensors:
            assert t.device.type == "cpu" and t.is_contiguous(), "an arena takes contiguous CPU tensors"
            key = (t.data_ptr(), t.nbytes)
            if key not in self.offsets:
                self.offsets[key] = total
                total += -(-t.nbytes // _ALIGN) * _ALIGN
        self.nbytes = total
        self.block, self.huge = empty(max(total, 1))
        self._moved: dict[int, torch.Tensor] = {}  # offset -> the copy

    def move(self, t: torch.Tensor) -> torch.Tensor:
        off = self.offsets[(t.data_ptr(), t.nbytes)]
        if off not in self._moved:
            copy = self.block[off:off + t.nbytes].view(t.dtype).view(t.shape)
            copy.copy_(t)
            self._moved[off] = copy
        return self._moved[off]
