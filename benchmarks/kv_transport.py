"""KV hand-off transport bandwidth: GB/s (1e9 bytes/s) of `send_chunk` for each transport and chunk size.

Each figure is the median over `--repeats` timed chunks (after one untimed warm-up chunk) of bytes /
wall time of one `send_chunk` call, which returns once the receiver holds the whole payload as a
tensor and its handler has returned: framing, the receiver's buffer allocation and the reply are
all inside. Also shown: the round trip of an empty commit, the fixed cost per call.

By default sender and receiver share this process and talk over loopback, which measures the
host's memory and TCP stack, not a network. For the figure to give the planner
(`meshserve plan --kv-transfer-bandwidth-gbs`), run the receiver on the decode host and the sender
on the prefill host:

    decode host:   python3 benchmarks/kv_transport.py --listen tcp --host 0.0.0.0 --port 47000
    prefill host:  python3 benchmarks/kv_transport.py --connect tcp://DECODE_HOST:47000

    python3 benchmarks/kv_transport.py [--transports inproc tcp pg] [--sizes-mib 1 8 64] [--repeats 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

import torch

from meshserve.kv_transfer.transport import TRANSPORTS, KVTransport, make_transport


class SinkHandler:
    """A receiver that drops what it gets, so only the transport is timed."""

    def __init__(self) -> None:
        self.chunks = 0
        self.bytes = 0

    def on_chunk(self, transfer_id: str, block_offset: int, payload: torch.Tensor) -> None:
        self.chunks += 1
        self.bytes += payload.numel() * payload.element_size()

    def on_commit(self, transfer_id: str, commit: dict[str, Any]) -> dict[str, Any]:
        return {"chunks": self.chunks}

    def on_abort(self, transfer_id: str) -> None:
        pass


def measure(sender: KVTransport, address: str, sizes_mib: list[float], repeats: int,
            timeout_s: float) -> dict[str, Any]:
    """{"gbs": {size_mib: {median, min, max}}, "commit_rtt_ms": median} against one receiver."""
    out: dict[str, Any] = {"gbs": {}}
    for size in sizes_mib:
        nbytes = int(size * (1 << 20)) // 2 * 2
        payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(torch.bfloat16)
        sender.send_chunk(address, "warmup", 0, payload, timeout_s)
        rates = []
        for i in range(repeats):
            start = time.perf_counter()
            sender.send_chunk(address, "bench", i, payload, timeout_s)
            rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        out["gbs"][size] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates)}
    rtts = []
    for _ in range(max(repeats, 20)):
        start = time.perf_counter()
        sender.commit(address, "bench", {}, timeout_s)
        rtts.append((time.perf_counter() - start) * 1e3)
    out["commit_rtt_ms"] = statistics.median(rtts)
    return out


def loopback(name: str, sizes_mib: list[float], repeats: int, timeout_s: float) -> dict[str, Any]:
    receiver, sender = make_transport(name), make_transport(name)
    try:
        return measure(sender, receiver.listen(SinkHandler()), sizes_mib, repeats, timeout_s)
    finally:
        sender.close()
        receiver.close()


def print_table(results: dict[str, dict[str, Any]], sizes_mib: list[float]) -> None:
    head = f"{'transport':<10}" + "".join(f"{f'{s:g} MiB GB/s':>16}" for s in sizes_mib) + f"{'commit RTT ms':>16}"
    print(head)
    print("-" * len(head))
    for name, res in results.items():
        cells = "".join(f"{res['gbs'][s]['median']:>16.2f}" for s in sizes_mib)
        print(f"{name:<10}{cells}{res['commit_rtt_ms']:>16.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--sizes-mib", nargs="+", type=float, default=[1.0, 8.0, 64.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--listen", choices=("tcp", "pg"), help="only run a receiver (on the decode host)")
    ap.add_argument("--host", default="127.0.0.1", help="with --listen: the interface to listen on")
    ap.add_argument("--port", type=int, default=0, help="with --listen")
    ap.add_argument("--connect", metavar="ADDRESS", help="only send, to a --listen receiver (tcp://... or pg://...)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args()

    if args.listen:
        receiver = make_transport(args.listen)
        print(f"receiver listening on {receiver.listen(SinkHandler(), args.host, args.port)}; Ctrl-C stops it",
              flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            receiver.close()
        return

    torch.set_num_threads(1)  # the payload is made once; the transports' own threads do the work
    if args.connect:
        name = args.connect.split("://", 1)[0]
        sender = make_transport(name)
        try:
            results = {name: measure(sender, args.connect, args.sizes_mib, args.repeats, args.timeout_s)}
        finally:
            sender.close()
    else:
        results = {name: loopback(name, args.sizes_mib, args.repeats, args.timeout_s) for name in args.transports}

    if args.json:
        print(json.dumps({"sizes_mib": args.sizes_mib, "repeats": args.repeats, "loopback": not args.connect,
                          "results": results}))
        return
    print_table(results, args.sizes_mib)
    net = "tcp" if "tcp" in results else next(iter(results))
    best = results[net]["gbs"][max(args.sizes_mib)]["median"]
    where = "over loopback (same host: an upper bound, not the network)" if not args.connect else "host to host"
    print(f"\n{net} at {max(args.sizes_mib):g} MiB chunks, {where}: "
          f"meshserve plan --kv-transfer-bandwidth-gbs {best:.2f}", file=sys.stdout)


if __name__ == "__main__":
    main()
