"""The arrival process has the requested mean gap and burstiness."""
from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from meshserve.bench.arrivals import arrival_offsets, inter_arrival_gaps, paced


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_have_requested_mean_and_coefficient_of_variation(burstiness):
    rate = 8.0
    gaps = inter_arrival_gaps(20_000, rate, burstiness, np.random.default_rng(1234))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once():
    assert not arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)).any()


def test_offsets_start_at_zero_and_repeat_with_the_seed():
    a = arrival_offsets(50, 4.0, 0.5, np.random.default_rng(7))
    b = arrival_offsets(50, 4.0, 0.5, np.random.default_rng(7))
    c = arrival_offsets(50, 4.0, 0.5, np.random.default_rng(8))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_paced_releases_items_at_their_offsets():
    async def collect():
        start = time.perf_counter()
        return [(item, time.perf_counter() - start)
                async for item in paced(["a", "b", "c"], np.array([0.0, 0.05, 0.12]))]

    got = asyncio.run(collect())
    assert [item for item, _ in got] == ["a", "b", "c"]
    assert got[1][1] >= 0.05 and got[2][1] >= 0.12  # never early: a sleep lasts at least its length
    # Not held back long past its offset either. Lateness here is this machine's (a busy one wakes a
    # sleeper late); the exact schedule, lateness included, is checked on a controlled clock below.
    assert got[2][1] < 0.12 + 2.0


def test_paced_keeps_to_absolute_times_when_the_event_loop_wakes_late(monkeypatch):
    """On a controlled clock, every sleep overruns by LATE: each release is late by one overrun, never
    by the sum of the earlier ones, and an item already due goes at once."""
    from types import SimpleNamespace

    from meshserve.bench import arrivals

    def releases(offsets: list[float], late: float) -> list[float]:
        now = [100.0]

        async def sleep(delay: float) -> None:
            assert delay > 0
            now[0] += delay + late
            await asyncio.sleep(0)

        monkeypatch.setattr(arrivals, "time", SimpleNamespace(perf_counter=lambda: now[0]))
        monkeypatch.setattr(arrivals, "asyncio", SimpleNamespace(sleep=sleep))

        async def collect():
            return [now[0] - 100.0 async for _ in paced(list(offsets), np.array(offsets))]

        return asyncio.run(collect())

    assert releases([0.0, 0.05, 0.12, 0.3], late=0.0) == pytest.approx([0.0, 0.05, 0.12, 0.3])
    # Relative sleeps would drift to 0.08, 0.18, 0.39.
    assert releases([0.0, 0.05, 0.12, 0.3], late=0.03) == pytest.approx([0.0, 0.08, 0.15, 0.33])
    # Woken 0.1 s late for b, c (due at 0.12) is overdue and goes at once, with b.
    assert releases([0.0, 0.05, 0.12, 0.3], late=0.1) == pytest.approx([0.0, 0.15, 0.15, 0.4])
