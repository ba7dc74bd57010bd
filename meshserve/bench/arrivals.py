"""When each request is sent: a gamma renewal process, Poisson when burstiness is 1.

Inter-arrival gaps are Gamma(shape=b, scale=1/(rate*b)): mean 1/rate whatever b is, and
coefficient of variation 1/sqrt(b). b < 1 is burstier than Poisson, b > 1 smoother.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")


def inter_arrival_gaps(n: int, rate: float, burstiness: float,
                       rng: np.random.Generator) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the start; the first request goes at once."""
    gaps = inter_arrival_gaps(n, rate, burstiness, rng)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if n else gaps


async def paced(items: Sequence[T], offsets: np.ndarray) -> AsyncIterator[T]:
    """Yield each item at its offset from now. Sleeping to absolute times keeps the
    schedule from drifting when the event loop is late for one request."""
    start = time.perf_counter()
    for item, offset in zip(items, offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
