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
