"""The host CPU's vendor and feature flags (Linux /proc/cpuinfo; none elsewhere)."""
from __future__ import annotations

import functools


def _first_field(name: str) -> list[str]:
    """The words after `name :` on the first such line of /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.split(":", 1)[0].strip() == name), [])
    except OSError:
        return []


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_first_field("flags"))


@functools.cache
def cpu_vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", ... ("" where it is not known)."""
    return " ".join(_first_field("vendor_id"))


def onednn_packs_bf16() -> bool:
    """oneDNN's packed bfloat16 linear runs on this CPU: it needs AVX-512 BW, VL and DQ, or
    AVX-NE-CONVERT (an AVX2-only CPU refuses the weight at packing time)."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
