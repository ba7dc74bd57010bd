"""The host CPU's feature flags (Linux /proc/cpuinfo; none elsewhere)."""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def onednn_packs_bf16() -> bool:
    """oneDNN's packed bfloat16 linear runs on this CPU: it needs AVX-512 BW, VL and DQ, or
    AVX-NE-CONVERT (an AVX2-only CPU refuses the weight at packing time)."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
