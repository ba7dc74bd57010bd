"""Disaggregated prefill/decode against colocated serving: the same arrivals on two replicas either way.

Two fleets, each started fresh on free loopback ports, every replica a process with OMP_NUM_THREADS=1
(a core each on a 2-core machine), a gateway in front:

    colocated  two `serve --kv-role both` replicas behind `gateway --backend A --backend B`
    split      `serve --kv-role prefill` + `serve --kv-role decode` (KV over tcp) behind
               `gateway --prefill P --decode D --disagg-min-tokens N`

Both get the same request set through `meshserve bench serve` (`run_serve`): a Poisson mix of long
documents (900-1000 tokens) and short chat turns (36-44 tokens), 30% long, 32 output tokens each,
written as a jsonl dataset, every prompt distinct (no prefix-cache hits by accident). With
`--repeats N` the fleets take turns N times and every figure is the median over the runs.

Before the loaded runs the hand-off is calibrated on the idle split pair: split requests of a few
prompt sizes, one at a time, each `kv_handoff` span's bytes and seconds fitted by least squares to
seconds = overhead + bytes / bandwidth. Those are the figures for `meshserve plan
--kv-transfer-bandwidth-gbs G --kv-transfer-overhead-ms M`.

Per fleet: TTFT and ITL p50/p95/p99, TPOT p50, goodput under the SLOs (and which class met them),
completed requests, and the cost per SLO-meeting request (both fleets pay for two replicas). For the
split run: each hand-off's bytes and seconds from the gateway's trace, their median GB/s, the
planner's `kv_handoff_time` for those bytes with the calibrated figures against the measured
seconds, and the gateway's hand-off outcome counts.

    python benchmarks/disagg.py                   # 40 requests at 0.5 req/s: several minutes
    python benchmarks/disagg.py --repeats 3 --json
    python benchmarks/disagg.py --quick --json    # a smoke run of a minute or two
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from meshserve.bench.config import BenchConfig, DatasetConfig, LoadConfig
from meshserve.bench.datasets import _WORDS
from meshserve.bench.report import table
from meshserve.bench.runner import run_serve
from meshserve.plan.timing import kv_handoff_time
from meshserve.utils.server_process import LaunchedServer, free_port

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("colocated", "split")
WORDS = _WORDS.split()  # the bench's own list of ordinary words: each is about one token
OUTCOMES = ("ok", "fallback", "skipped")
HANDOFFS = "meshserve:gateway_kv_handoffs_total"
# Small enough for a smoke test (two fleets started, a minute or two on 2 cores) and still a real
# split: the long prompts exceed --disagg-min-tokens and the short ones do not.
QUICK = {"num_prompts": 6, "request_rate": 2.0, "long_len": (160, 200), "short_len": (20, 28), "output_len": 8,
         "disagg_min_tokens": 64, "calib_sizes": (96, 384), "calib_repeats": 2, "long_fraction": 0.5}
KEYS = ("completed", "failed", "duration", "p50_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p95_itl_ms",
        "p99_itl_ms", "p50_tpot_ms", "output_throughput", "good_requests", "request_goodput", "slo_attainment",
        "cost_per_request", "cost_per_goodput_request")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals, req/s")
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--long-len", type=_ints, default=(900, 1000), metavar="MIN,MAX", help="long prompts, tokens")
    p.add_argument("--short-len", type=_ints, default=(36, 44), metavar="MIN,MAX", help="short prompts, tokens")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=200_000_000, metavar="BYTES", help="per replica")
    p.add_argument("--disagg-min-tokens", type=int, default=256, help="the split gateway's threshold")
    p.add_argument("--calib-sizes", type=_ints, default=(320, 640, 1280), metavar="N,N,...",
                   help="calibration prompt sizes, tokens (each above --disagg-min-tokens)")
    p.add_argument("--calib-repeats", type=int, default=3, help="calibration requests per size")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--cost-per-replica-hour", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=1, help="rounds in which the fleets take turns; medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S", help="per request")
    p.add_argument("--log-dir", help="server logs, dataset, traces (default: a new temporary directory)")
    p.add_argument("--quick", action="store_true", help="a small smoke run: " + json.dumps(QUICK))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**QUICK)  # flags given explicitly still win
    a = p.parse_args(argv)
    if not (a.long_len[0] <= a.long_len[-1] and a.short_len[-1] < a.long_len[0]):
        p.error("--short-len must lie below --long-len, each MIN,MAX")
    if a.long_len[-1] + a.output_len > a.max_model_len or max(a.calib_sizes) + 2 > a.max_model_len:
        p.error("--max-model-len must hold the longest prompt and its output")
    if min(a.calib_sizes) <= a.disagg_min_tokens or len(set(a.calib_sizes)) < 2:
        p.error("--calib-sizes needs two or more sizes, each above --disagg-min-tokens (or nothing is split)")
    return a


def _prompt(rng: random.Random, tag: str, n: int) -> str:
    # A tag of its own up front and random words after it: no two prompts share a 16-token block.
    return f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(max(1, n - 4)))


def write_dataset(a: argparse.Namespace, path: str) -> list[bool]:
    """The jsonl request set (in arrival order); which rows are long."""
    rng = random.Random(a.seed)
    n_long = round(a.num_prompts * a.long_fraction)
    is_long = [True] * n_long + [False] * (a.num_prompts - n_long)
    rng.shuffle(is_long)
    with open(path, "w", encoding="utf-8") as f:
        for i, long_ in enumerate(is_long):
            lo_hi = a.long_len if long_ else a.short_len
            n = rng.randint(lo_hi[0], lo_hi[-1])
            tag = f"Document {i} to summarize" if long_ else f"Question {i}"
            f.write(json.dumps({"prompt": _prompt(rng, tag, n), "max_tokens": a.output_len}) + "\n")
    return is_long


def _process(argv: list[str], log_dir: str, name: str) -> LaunchedServer:
    port = free_port()
    # One thread each: two replicas share the two cores without oversubscribing them.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return LaunchedServer([sys.executable, "-m", "meshserve", *argv, "--host", "127.0.0.1", "--port", str(port)],
                          os.path.join(log_dir, f"{name}.log"), port=port, env=env, cwd=str(REPO))


@contextlib.contextmanager
def fleet(config: str, a: argparse.Namespace, log_dir: str, tag: str) -> Iterator[SimpleNamespace]:
    """Two replicas and a gateway, stopped on the way out whatever happened."""
    started: list[LaunchedServer] = []
    try:
        serve = ["serve", a.model, "--max-model-len", str(a.max_model_len), "--kv-cache-memory",
                 str(a.kv_cache_memory), "--log-level", "info"]
        roles = ("both", "both") if config == "colocated" else ("prefill", "decode")
        replicas = []
        for i, role in enumerate(roles):
            extra = [] if role == "both" else ["--kv-transport", "tcp"]
            if role == "decode":  # loopback, any free port for the KV listener
                extra += ["--kv-host", "127.0.0.1", "--kv-port", "0"]
            replicas.append(_process(serve + ["--kv-role", role, *extra], log_dir, f"{tag}-{role}{i}"))
        for r in replicas:
            started.append(r.start())
        for r in replicas:
            r.wait_ready(600)
        trace = os.path.join(log_dir, f"{tag}-trace.jsonl")
        argv = ["gateway", "--log-level", "info", "--trace-file", trace,
                "--disagg-min-tokens", str(a.disagg_min_tokens)]
        if config == "colocated":
            argv += [x for r in replicas for x in ("--backend", r.url)]
        else:
            argv += ["--prefill", replicas[0].url, "--decode", replicas[1].url]
        gateway = _process(argv, log_dir, f"{tag}-gateway")
        started.append(gateway.start())
        gateway.wait_ready(60)
        with urllib.request.urlopen(gateway.url + "/v1/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        yield SimpleNamespace(config=config, gateway=gateway, replicas=replicas, trace=trace, model=model)
    finally:
        for proc in reversed(started):
            proc.stop()


def _complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


def warm_up(f: SimpleNamespace, a: argparse.Namespace) -> None:
    """A short and a long prompt of their own on every replica that takes client requests (through the
    gateway for the split fleet, so both its replicas run one), so no timed request pays for a first."""
    rng = random.Random(a.seed + 1)
    urls = [r.url for r in f.replicas] if f.config == "colocated" else [f.gateway.url]
    for i, url in enumerate(urls):
        for n in (a.short_len[0], a.long_len[0]):
            _complete(url, f.model, _prompt(rng, f"Warm-up {i} {n}", n), 2, a.request_timeout)


def handoff_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(OUTCOMES, 0.0)
    for line in text.splitlines():
        if line.startswith(HANDOFFS + "{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(line.rpartition(" ")[2])
    return out


def handoff_spans(trace: str, since_ns: int, want: int, timeout_s: float = 15.0) -> list[dict]:
    """The kv_handoff spans begun since `since_ns` (a client's leaving aside), once `want` of them are
    in the file: the gateway exports in batches every half second."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = []
        with contextlib.suppress(FileNotFoundError), open(trace, encoding="utf-8") as f:
            for line in f:
                s = json.loads(line) if '"kv_handoff"' in line else None
                if s and s["name"] == "kv_handoff" and s["start_ns"] >= since_ns \
                        and s["attributes"].get("meshserve.outcome") != "cancelled":
                    spans.append(s["attributes"])
        if len(spans) >= want or time.monotonic() > deadline:
            return spans
        time.sleep(0.25)


def fit_handoff(points: list[tuple[int, float]]) -> dict:
    """seconds = overhead + bytes / bandwidth by least squares, neither term negative (a negative
    overhead or slope is noise: the constrained optimum then lies on that boundary)."""
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    slope, overhead = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, -1.0)
    if overhead < 0:
        slope, overhead = float(x @ y / (x @ x)), 0.0
    if slope <= 0:
        slope, overhead = 0.0, float(y.mean())
    resid = y - (overhead + slope * x)
    r2 = 1 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum()) if len(y) > 1 and y.std() > 0 else None
    return {"bandwidth_gbs": 1 / slope / 1e9 if slope > 0 else None, "overhead_ms": overhead * 1e3, "r2": r2,
            "points": [{"bytes": int(b), "seconds": s} for b, s in points]}


def calibrate(f: SimpleNamespace, a: argparse.Namespace) -> dict:
    """Split requests one at a time on the idle pair: what one hand-off costs with nothing else running."""
    rng = random.Random(a.seed + 2)
    since = time.time_ns()
    for n in a.calib_sizes:
        for i in range(a.calib_repeats):
            _complete(f.gateway.url, f.model, _prompt(rng, f"Calibration {n} {i}", n), 2, a.request_timeout)
    spans = handoff_spans(f.trace, since, len(a.calib_sizes) * a.calib_repeats)
    points = [(s["meshserve.kv.bytes"], s["meshserve.kv.seconds"]) for s in spans if s["meshserve.outcome"] == "ok"]
    if len(points) < 2:
        raise RuntimeError(f"calibration: {len(points)} ok hand-offs of {len(spans)} (see {f.trace} and the logs)")
    return {"requests": len(spans), "prompt_sizes": list(a.calib_sizes), **fit_handoff(points)}


def run_one(config: str, a: argparse.Namespace, log_dir: str, dataset: str, is_long: list[bool], tag: str,
            calibration: dict | None) -> tuple[dict, dict | None]:
    with fleet(config, a, log_dir, tag) as f:
        warm_up(f, a)
        if config == "split" and calibration is None:
            calibration = calibrate(f, a)
        before, since = handoff_counts(f.gateway.url), time.time_ns()
        bench = BenchConfig(
            base_url=f.gateway.url, num_warmups=0, show_progress=False, percentiles=(50.0, 95.0, 99.0),
            request_timeout_s=a.request_timeout, goodput={"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms},
            cost_per_replica_hour=a.cost_per_replica_hour, num_replicas=2,
            dataset=DatasetConfig(name="jsonl", path=dataset, seed=a.seed),
            load=LoadConfig(request_rate=a.request_rate, burstiness=1.0))
        result = run_serve(bench, label=config)
        after = handoff_counts(f.gateway.url)
        outcomes = {k: int(after[k] - before[k]) for k in OUTCOMES}
        spans = handoff_spans(f.trace, since, sum(outcomes.values())) if config == "split" else []
    row = {k: result.get(k) for k in KEYS}
    row["slo_met"], row["errors"] = slo_by_class(result, is_long, a), result.get("errors") or {}
    if config == "split":
        row["handoff_outcomes"] = outcomes
        row["handoffs"] = [{"bytes": s["meshserve.kv.bytes"], "seconds": s["meshserve.kv.seconds"],
                            "tokens": s.get("meshserve.kv.tokens")} for s in spans if s["meshserve.outcome"] == "ok"]
        row["fallback_reasons"] = dict(Counter(s.get("meshserve.reason", "") for s in spans
                                               if s["meshserve.outcome"] == "fallback"))
    return row, calibration


def slo_by_class(result: dict, is_long: list[bool], a: argparse.Namespace) -> dict:
    """Requests within both SLOs per class (long, short), as [met, sent]: whom each fleet serves well."""
    pr = result["per_request"]
    cut = (a.short_len[-1] + a.long_len[0]) / 2
    out = {"long": [0, sum(is_long)], "short": [0, len(is_long) - sum(is_long)]}
    for n, ttft, tpot in zip(pr["prompt_tokens"], pr["ttft_s"], pr["tpot_s"]):
        if ttft * 1e3 <= a.slo_ttft_ms and (tpot or 0.0) * 1e3 <= a.slo_tpot_ms:
            out["long" if (n or 0) > cut else "short"][0] += 1
    return out


def handoff_summary(rows: list[dict], calibration: dict) -> dict:
    """The split runs' hand-offs, pooled, against the planner's prediction from the calibration."""
    hs = [h for r in rows for h in r["handoffs"] if h["seconds"] > 0]
    outcomes = {k: sum(r["handoff_outcomes"][k] for r in rows) for k in OUTCOMES}
    reasons = sum((Counter(r["fallback_reasons"]) for r in rows), Counter())
    out: dict = {"outcomes": outcomes, "fallback_reasons": dict(reasons), "count": len(hs)}
    if not hs:
        return out
    out.update(median_bytes=statistics.median(h["bytes"] for h in hs),
               median_seconds=statistics.median(h["seconds"] for h in hs),
               median_gbs=statistics.median(h["bytes"] / h["seconds"] / 1e9 for h in hs))
    bw = calibration["bandwidth_gbs"]
    if bw:
        ratios = [kv_handoff_time(h["bytes"], bw * 1e9, calibration["overhead_ms"] / 1e3) / h["seconds"] for h in hs]
        out.update(median_predicted_over_measured=statistics.median(ratios),
                   within_25pct=sum(abs(r - 1) <= 0.25 for r in ratios) / len(ratios), ratios=ratios)
    return out


def _median(rows: list[dict]) -> dict:
    out: dict = {}
    for k in KEYS:
        vals = [r[k] for r in rows if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    out["slo_met"] = {c: [statistics.median(r["slo_met"][c][0] for r in rows), rows[0]["slo_met"][c][1]]
                      for c in ("long", "short")}
    return out


def _ms(row: dict, name: str) -> str:
    vals = [row[f"p{p}_{name}_ms"] for p in (50, 95, 99)]
    return " / ".join("-" if v is None else f"{v:,.0f}" for v in vals)


def print_tables(doc: dict, a: argparse.Namespace) -> None:
    n_long = sum(doc["is_long"])
    print(f"{a.num_prompts} requests at {a.request_rate:g} req/s (Poisson, seed {a.seed}): {n_long} long "
          f"({a.long_len[0]}-{a.long_len[-1]} tokens), {a.num_prompts - n_long} short ({a.short_len[0]}-"
          f"{a.short_len[-1]}), {a.output_len} output tokens each; {a.repeats} run(s) per fleet, medians")
    print(f"colocated: 2 x serve --kv-role both | split: prefill + decode, tcp, --disagg-min-tokens "
          f"{a.disagg_min_tokens} | one thread per replica | SLO TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= "
          f"{a.slo_tpot_ms:g} ms | {a.cost_per_replica_hour:g} per replica-hour x 2 replicas\n")
    headers = ["fleet", "completed", "TTFT p50/p95/p99 ms", "ITL p50/p95/p99 ms", "TPOT p50 ms", "goodput req/s",
               "SLO met", "long met", "short met", "cost/good req"]
    body = []
    for config in CONFIGS:
        r = doc["fleets"][config]["median"]
        slo = r["slo_met"]
        cost = r["cost_per_goodput_request"]
        body.append([config, f"{r['completed']:g}/{a.num_prompts}", _ms(r, "ttft"), _ms(r, "itl"),
                     f"{r['p50_tpot_ms']:.0f}", f"{r['request_goodput']:.3f}", f"{r['slo_attainment']:.0%}",
                     f"{slo['long'][0]:g}/{slo['long'][1]}", f"{slo['short'][0]:g}/{slo['short'][1]}",
                     "n/a" if cost is None else f"{cost:.3g}"])
    print(table(headers, body))
    for config in CONFIGS:  # what failed, summed over the runs
        errors = sum((Counter(r["errors"]) for r in doc["fleets"][config]["runs"]), Counter())
        print("".join(f"{config} failed x{n}: {why}\n" for why, n in errors.items()), end="")
    cal, h = doc["calibration"], doc["handoffs"]
    bw = "n/a (no growth with bytes)" if cal["bandwidth_gbs"] is None else f"{cal['bandwidth_gbs']:.3f} GB/s"
    r2 = "" if cal["r2"] is None else f", r^2 {cal['r2']:.2f}"
    print(f"\nhand-off calibration, idle pair ({cal['requests']} split requests of {cal['prompt_sizes']} tokens): "
          f"{bw}, overhead {cal['overhead_ms']:.1f} ms{r2}")
    if cal["bandwidth_gbs"] is not None:
        print(f"  meshserve plan --kv-transfer-bandwidth-gbs {cal['bandwidth_gbs']:.3g} "
              f"--kv-transfer-overhead-ms {cal['overhead_ms']:.3g}")
    o = h["outcomes"]
    # Per attempt, as the gateway counts them: a request whose attempt failed has a second one.
    print(f"split run hand-off attempts: ok {o['ok']}, fallback {o['fallback']}, skipped {o['skipped']}", end="")
    if h["count"]:
        print(f"; median {h['median_bytes'] / 1e6:.1f} MB in {h['median_seconds'] * 1e3:.0f} ms, "
              f"{h['median_gbs']:.3f} GB/s", end="")
    print("".join(f"\n  fallback x{n}: {why}" for why, n in h["fallback_reasons"].items()))
    if "median_predicted_over_measured" in h:
        print(f"planner kv_handoff_time / measured: median {h['median_predicted_over_measured']:.2f}x, "
              f"{h['within_25pct']:.0%} of {h['count']} hand-offs within 25%")
    print(f"\nlogs, dataset and traces: {doc['log_dir']}")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    # SIGTERM (a test's timeout, a job runner) unwinds like Ctrl-C, so every fleet's `finally` stops its servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="meshserve-disagg-")
    os.makedirs(log_dir, exist_ok=True)
    dataset = os.path.join(log_dir, "workload.jsonl")
    is_long = write_dataset(a, dataset)
    runs: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    calibration = None
    for rnd in range(a.repeats):
        for config in CONFIGS:  # taking turns: a slow spell of the machine falls on both fleets
            row, calibration = run_one(config, a, log_dir, dataset, is_long, f"r{rnd}-{config}", calibration)
            runs[config].append(row)
            print(f"round {rnd + 1}/{a.repeats} {config}: {row['completed']}/{a.num_prompts} completed",
                  file=sys.stderr)
    assert calibration is not None
    doc = {"settings": {k: v for k, v in vars(a).items()}, "log_dir": log_dir, "is_long": is_long,
           "calibration": calibration, "handoffs": handoff_summary(runs["split"], calibration),
           "fleets": {c: {"median": _median(runs[c]), "runs": runs[c]} for c in CONFIGS}}
    if a.json:
        print(json.dumps(doc, indent=2))
    else:
        print_tables(doc, a)
    ok = all(r["failed"] == 0 and r["completed"] > 0 for rs in runs.values() for r in rs)
    return 0 if ok and doc["handoffs"]["outcomes"]["ok"] > 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the fleets' servers are stopped by then
        sys.exit(130)
