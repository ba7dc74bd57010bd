"""Giving freed heap memory back to the system."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc


def release_free_heap() -> None:
    """Return the pages malloc keeps after large frees (glibc only; elsewhere a no-op). Loading a
    model copies and frees its tensors; glibc keeps those pages for reuse, so the process would
    stay as large as its loading peak (on a 4-bit model, that is twice the weights)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
