"""The host CPU's vendor and feature flags (Linux /proc/cpuinfo; none elsewhere), and what oneDNN
may use of them."""
from __future__ import annotations

import functools
import os

# oneDNN's instruction-set levels in the order ONEDNN_MAX_CPU_ISA caps them (with the older names
# it still reads); a cap below a level stops oneDNN from using it whatever the CPU has.
_ONEDNN_LEVELS = ["SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                  "AVX512_CORE_BF16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                  "AVX10_2_512", "AVX10_2_512_AMX_2"]
_ONEDNN_ALIASES = {"AVX512_CORE_FP16": "AVX10_1_512", "AVX512_CORE_AMX": "AVX10_1_512_AMX",
                   "AVX512_CORE_AMX_FP16": "AVX10_1_512_AMX_FP16"}


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


@functools.cache
def _onednn_cap() -> int | None:
    """ONEDNN_MAX_CPU_ISA's place in _ONEDNN_LEVELS, read once as oneDNN reads it (the matmul rules
    ask on every call); None where unset, "ALL", "DEFAULT" or a name it does not know: no cap."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    cap = _ONEDNN_ALIASES.get(cap, cap)
    return _ONEDNN_LEVELS.index(cap) if cap in _ONEDNN_LEVELS else None


def onednn_allows(level: str) -> bool:
    """Whether oneDNN's cap (ONEDNN_MAX_CPU_ISA) lets it use `level`."""
    cap = _onednn_cap()
    return cap is None or _ONEDNN_LEVELS.index(_ONEDNN_ALIASES.get(level, level)) <= cap


def onednn_packs_bf16() -> bool:
    """oneDNN's packed bfloat16 linear runs on this CPU: it needs AVX-512 BW, VL and DQ, or
    AVX-NE-CONVERT (an AVX2-only CPU, or oneDNN capped below them, refuses the weight at packing
    time)."""
    flags = cpu_flags()
    return ({"avx512bw", "avx512vl", "avx512dq"} <= flags and onednn_allows("AVX512_CORE")) or \
        ("avx_ne_convert" in flags and onednn_allows("AVX2_VNNI_2"))


def cpu_bf16_matmul_isa() -> str | None:
    """The instructions oneDNN multiplies bfloat16 with here ("AMX" or "AVX512-BF16"), or None. It
    packs bfloat16 weights for AVX512-BF16 only with AVX-512 BW and VL beside it."""
    flags = cpu_flags()
    if "amx_bf16" in flags and onednn_allows("AVX512_CORE_AMX"):
        return "AMX"
    if {"avx512_bf16", "avx512bw", "avx512vl"} <= flags and onednn_allows("AVX512_CORE_BF16"):
        return "AVX512-BF16"
    return None
