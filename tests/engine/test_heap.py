"""keep_freed_heap: once it is on, a step's freed activations are reused without page faults."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshserve.utils import heap

_GLIBC = heap._libc() is not None and hasattr(heap._libc(), "mallopt")

# Allocates, fills and frees a 64 MB tensor (past glibc's largest dynamic mmap threshold, 32 MB)
# as a step does, and prints the minor page faults of five such steps once the heap has settled: small
# allocations between steps can split a freed block, so the first few steps may still take fresh
# pages from the top of the heap (seen: up to 8) before freed blocks coalesce and are reused.
_PROBE = """
import resource, sys, torch
from meshserve.utils.heap import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
elif sys.argv[1] == "engine":  # a CPU engine in this process turns it on
    from meshserve import LLM
    LLM(sys.argv[2], dtype="float32", kv_cache_memory_bytes=1 << 24)
def fill():
    torch.empty(16 << 20, dtype=torch.float32).fill_(1.0)
for _ in range(20):
    fill()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    fill()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _settled_faults(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _GLIBC, reason="mallopt is glibc's")
def test_freed_step_buffers_are_reused_without_page_faults(peaked_model):
    pages = 5 * (64 << 20) // 4096
    assert _settled_faults("default") > pages // 2  # glibc maps and faults the block in every time
    assert _settled_faults("keep") < pages // 50
    assert _settled_faults("engine", peaked_model) < pages // 50
