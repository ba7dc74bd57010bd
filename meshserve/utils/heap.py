"""How the process's heap hands memory back to the system: all at once after loading, never
between steps."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap once steps run, and up to this much free space stays at
# its top: a step's activations (a 2048-token prompt chunk's MLP output is 25 MB on the embedded
# model) stay far below it.
STEP_BLOCK_MAX_BYTES = 1 << 30


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name is not None else None


def release_free_heap() -> None:
    """Return the pages malloc keeps after large frees (glibc only; elsewhere a no-op). Loading a
    model copies and frees its tensors; glibc keeps those pages for reuse, so the process would
    stay as large as its loading peak (on a 4-bit model, that is twice the weights)."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def keep_freed_heap() -> bool:
    """From now on keep freed blocks of up to STEP_BLOCK_MAX_BYTES for the next allocation instead
    of handing their pages back (glibc only; False elsewhere). A CPU step allocates and frees
    activations of tens of MB; glibc serves blocks past its mmap threshold (at most 32 MB) with
    fresh mappings and unmaps them on free, and trims the heap's top, so every step faulted its
    pages in and had the kernel zero them again: 14% of a 2048-token prefill step on the embedded
    model. The process grows for the first few steps (small allocations can split a freed block
    before it is reused) and then stays at that steady-state peak, as it would with tcmalloc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, STEP_BLOCK_MAX_BYTES)
                and libc.mallopt(_M_TRIM_THRESHOLD, STEP_BLOCK_MAX_BYTES))
