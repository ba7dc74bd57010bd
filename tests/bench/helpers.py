"""Test helpers: the fake server in a subprocess, and the bench CLI without the rest of
meshserve's subcommands."""
from __future__ import annotations

import argparse
import contextlib
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))
# Point the end-to-end checks at a real server instead of the fake one, e.g.
# MESHSERVE_BENCH_BASE_URL=http://127.0.0.1:8000 after `meshserve serve --port 8000`.
REAL_SERVER_ENV = "MESHSERVE_BENCH_BASE_URL"


@contextlib.contextmanager
def fake_server(*args: str, timeout_s: float = 20.0) -> Iterator[str]:
    """Start tests/bench/fake_server.py on a free 127.0.0.1 port; yield its base URL."""
    proc = subprocess.Popen([sys.executable, FAKE_SERVER, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line.startswith("READY") and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
            if ready:
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    break
        if not line.startswith("READY"):
            raise RuntimeError(f"fake server did not start: {line!r}")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Deterministic delays large enough that scheduling noise on a busy machine stays small beside the
# 5% by which test_e2e lets two clients' latencies differ: a busy machine delays a client's reading
# of a stream by a few ms (at 150 ms / 30 ms, with two cores kept busy, the clients' TTFT means and
# ITL medians came 5-10% apart; at these, under 1%), while the bugs that check catches move a
# figure by 12% or more (TPOT over n tokens instead of n - 1, the first token's wait counted as an
# ITL, the role-only chunk taken for the first token).
# The end-to-end fake server's schedule: token i leaves TTFT + i x ITL after a request arrives.
E2E_TTFT_MS, E2E_ITL_MS = 500.0, 100.0
E2E_SERVER_ARGS = ("--ttft-ms", str(E2E_TTFT_MS), "--itl-ms", str(E2E_ITL_MS))


def run_bench(argv: list[str]) -> int:
    """`meshserve bench ...` through this package's parser alone."""
    from meshserve.bench.cli import register

    parser = argparse.ArgumentParser(prog="meshserve")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    args = parser.parse_args(["bench", *argv])
    return args.func(args)
