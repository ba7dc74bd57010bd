"""60 simultaneous requests against a KV budget that fits 10: admission never over-reserves (the
engines' own ledgers say so, sampled throughout), every request ends with an answer or a defined
error, and every reservation is gone at the end; with one gateway and with two in front of the
same replicas."""
import asyncio
import random
import threading

import pytest

from tests.gateway.fleet import (
    BLOCK_SIZE,
    complete,
    get_json,
    reservations,
    run,
    session,
)

REQUESTS = 60
FITS = 10
MAX_TOKENS = 4
DEFINED_ERRORS = {"deadline_exceeded", "queue_full", "replicas_busy", "no_healthy_replica"}


class LedgerWatch:
    """Samples every replica's reservation ledger until stopped: the most blocks and leases live at once."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.max_reserved = [0] * len(urls)
        self.max_leases = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            ledgers = [reservations(u) for u in self.urls]
            for i, ledger in enumerate(ledgers):
                self.max_reserved[i] = max(self.max_reserved[i], ledger["reserved_blocks"])
            self.max_leases = max(self.max_leases, sum(len(ledger["leases"]) for ledger in ledgers))
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def _request_blocks(num_blocks: list[int]) -> int:
    """Blocks per request such that the fleet holds exactly FITS requests at once."""
    for k in range(1, max(num_blocks) + 1):
        if sum(n // k for n in num_blocks) <= FITS:
            assert sum(n // k for n in num_blocks) == FITS, (num_blocks, k)
            return k
    raise AssertionError(num_blocks)


@pytest.mark.parametrize("gateways", [1, 2])
def test_simultaneous_requests_never_over_reserve(fleet, gateways):
    num_blocks = [reservations(u)["num_blocks"] for u in fleet.urls]
    k = _request_blocks(num_blocks)
    prompt_len = k * BLOCK_SIZE - MAX_TOKENS  # prompt + max_tokens fill exactly k blocks
    rng = random.Random(gateways)
    prompts = [[1000 + i] + [rng.randrange(2000, 20000) for _ in range(prompt_len - 1)] for i in range(REQUESTS)]
    gws = [fleet.gateway("--policy", "least_load") for _ in range(gateways)]

    async def race():
        async with session() as s:
            return await asyncio.gather(*(
                complete(s, gws[i % gateways].url, {"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True},
                         headers={"X-Request-Deadline-Ms": "90000"}) for i, p in enumerate(prompts)))

    with LedgerWatch(fleet.urls) as watch:
        results = run(race(), timeout_s=200)
    for i, ledger in enumerate(reservations(u) for u in fleet.urls):
        assert watch.max_reserved[i] <= ledger["num_blocks"]
        assert all(e["peak_reserved_blocks"] <= e["num_blocks"] for e in ledger["engines"]), ledger
        assert ledger["reserved_blocks"] == 0 and ledger["leases"] == [], ledger
    assert 2 <= watch.max_leases <= FITS, watch.max_leases  # it ran in parallel, never past the budget
    ok = [r for r in results if r[0] == 200]
    errors = [r for r in results if r[0] != 200]
    assert all(len(body["choices"][0]["text"]) > 0 or body["usage"]["completion_tokens"] == MAX_TOKENS
               for _, body, _ in ok)
    assert all(body["error"]["code"] in DEFINED_ERRORS and "Retry-After" in headers for _, body, headers in errors)
    assert len(ok) >= REQUESTS // 2, [e[1] for e in errors[:3]]
    for gw in gws:  # the gateways hold no lease records either
        assert all(r["leases"] == 0 and r["ledger"]["in_flight"] == 0
                   for r in get_json(gw.url + "/gateway/replicas")["replicas"])
        fleet.stop_gateway(gw)
