"""Console tables and result files."""
from __future__ import annotations

import datetime as dt
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from meshserve.bench.config import METRICS
from meshserve.bench.metrics import percentile_key

TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
WIDTH = 50


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table: first column left, the others right."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


COST_FIELDS = ("fleet_cost", "cost_per_request", "cost_per_goodput_request", "cost_per_million_output_tokens")


def money(value: float | None) -> str:
    """Significant digits, not fixed decimals: a cost per request is often a few millionths."""
    return "n/a" if value is None else f"{value:.5g}"


def _kv(name: str, value: Any) -> str:
    return f"{name + ':':<{WIDTH - 10}}{fmt(value):>10}"


def _rule(title: str = "", fill: str = "-") -> str:
    return f" {title} ".center(WIDTH, fill) if title else fill * WIDTH


def format_result(r: dict) -> str:
    env_model = (r.get("environment") or {}).get("model") or {}
    lines = [_rule("Serving Benchmark Result", "="),
             f"Model: {r.get('model_id')}  revision: {env_model.get('revision') or 'n/a'}",
             f"Endpoint: {r.get('endpoint')}  dataset: {r['dataset']['name']}",
             f"Load: rate {r.get('request_rate')}, burstiness {r.get('burstiness')}, "
             f"max concurrency {r.get('max_concurrency') or 'none'}",
             _kv("Successful requests", r["completed"]),
             _kv("Failed requests", r["failed"])]
    lines += [_kv(f"  {kind}", count) for kind, count in r.get("errors", {}).items()]
    lines += [_kv("Benchmark duration (s)", r["duration"]),
              _kv("Total input tokens", r["total_input_tokens"]),
              _kv("Total generated tokens", r["total_output_tokens"]),
              _kv("Request throughput (req/s)", r["request_throughput"])]
    if "request_goodput" in r:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in r["goodput_slos_ms"].items())
        lines += [_kv("Request goodput (req/s)", r["request_goodput"]),
                  _kv("SLO attainment (%)", 100.0 * r["slo_attainment"]),
                  f"  SLO: {slos}"]
    lines += [_kv("Output token throughput (tok/s)", r["output_throughput"]),
              _kv("Total token throughput (tok/s)", r["total_token_throughput"])]
    if "fleet_cost" in r:
        lines += [_rule("Cost"),
                  _kv("Cost per replica-hour", money(r["cost_per_replica_hour"])),
                  _kv("Replicas", r["num_replicas"]),
                  _kv("Fleet cost (whole run)", money(r["fleet_cost"])),
                  _kv("Cost per request", money(r["cost_per_request"]))]
        if "cost_per_goodput_request" in r:
            lines.append(_kv("Cost per goodput request", money(r["cost_per_goodput_request"])))
        lines.append(_kv("Cost per million output tokens", money(r["cost_per_million_output_tokens"])))
    if r.get("requests_without_usage"):
        lines.append(f"  note: {r['requests_without_usage']} responses had no usage; their "
                     "output tokens were counted from chunks")
    for name in r.get("percentile_metrics", METRICS):
        title, short = TITLES[name]
        lines.append(_rule(title))
        lines += [_kv(f"{stat.capitalize()} {short} (ms)", r.get(f"{stat}_{name}_ms"))
                  for stat in ("mean", "median", "std")]
        lines += [_kv(f"P{percentile_key(p)[1:]} {short} (ms)",
                      r.get(f"{percentile_key(p)}_{name}_ms"))
                  for p in r.get("metric_percentiles", [])]
    lines.append(_rule(fill="="))
    return "\n".join(lines)


def comparable_fields(a: dict, b: dict) -> list[str]:
    """Numeric result fields present in both, in the order of the result table."""
    head = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "slo_attainment", "output_throughput",
            "total_token_throughput", *COST_FIELDS]
    metric = [k for name in METRICS for k in a
              if re.fullmatch(rf"(mean|median|std|p[\d.]+)_{name}_ms", k)]
    return [k for k in head + metric
            if isinstance(a.get(k), (int, float)) and isinstance(b.get(k), (int, float))]


def format_compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Two results side by side; the ratio column is B / A."""
    def describe(name: str, r: dict) -> str:
        env = (r.get("environment") or {}).get("model") or {}
        ds = r.get("dataset") or {}
        fleet = (f", {r['num_replicas']} replica(s) at {money(r['cost_per_replica_hour'])}/h"
                 if "fleet_cost" in r else "")
        return (f"{name}: model {r.get('model_id')} (revision {env.get('revision') or 'n/a'}), "
                f"dataset {ds.get('name')} x{r.get('num_requests')}, rate {r.get('request_rate')}, "
                f"max concurrency {r.get('max_concurrency') or 'none'}{fleet}")

    rows = []
    for key in comparable_fields(a, b):
        va, vb = a[key], b[key]
        shown = (money(va), money(vb)) if key in COST_FIELDS else (va, vb)
        rows.append([key, *shown, (vb / va) if va else None])
    out = [describe(name_a, a), describe(name_b, b)]
    for key in ("dataset", "request_rate", "max_concurrency", "endpoint"):
        if a.get(key) != b.get(key):
            out.append(f"note: the runs differ in {key}; ratios compare different workloads")
    out += ["", table(["metric", name_a, name_b, f"{name_b}/{name_a}"], rows)]
    return "\n".join(out)


def result_filename(kind: str, r: dict) -> str:
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(r.get("model_id") or "model"))[-48:]
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{kind}-{model}-{stamp}.json"


def save_json(obj: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path


def load_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
            return result
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read result file {path!r}: {exc}") from None


def format_sweep_point(kind: str, point: dict) -> str:
    r = point["result"]
    cost = (f", {money(r['cost_per_goodput_request'])} per goodput request"
            if "cost_per_goodput_request" in r else "")
    return (f"{kind} {point['load']:g}: {r['completed']}/{r['num_requests']} completed, "
            f"goodput {r['request_goodput']:.2f} req/s, SLO attainment "
            f"{100 * r['slo_attainment']:.1f}%{cost} -> {'pass' if point['passed'] else 'FAIL'}")


def format_sweep(sweep: dict) -> str:
    # Without --cost-per-replica-hour a cost column would be n/a on every row.
    priced = any("cost_per_goodput_request" in p["result"] for p in sweep["points"])
    rows = []
    for p in sweep["points"]:
        r = p["result"]
        cost = [money(r.get("cost_per_goodput_request"))] if priced else []
        rows.append([f"{p['load']:g}", r["request_throughput"], r["request_goodput"],
                     100 * r["slo_attainment"], r.get("p50_ttft_ms"), r.get("p95_ttft_ms"),
                     r.get("p99_ttft_ms"), r.get("p95_tpot_ms"), r.get("p95_itl_ms"),
                     r.get("p95_e2el_ms"), r["failed"], *cost, "yes" if p["passed"] else "NO"])
    headers = [sweep["load_label"], "req/s", "goodput", "attain %", "TTFT p50", "TTFT p95",
               "TTFT p99", "TPOT p95", "ITL p95", "E2EL p95", "failed",
               *(["cost/good req"] if priced else []), "SLO ok"]
    slos = ", ".join(f"{k}<={v:g}ms" for k, v in sweep["goodput_slos_ms"].items())
    best = sweep["max_load_meeting_slo"]
    verdict = (f"highest {sweep['load_label']} meeting the SLO: {best:g}" if best is not None
               else "no load point met the SLO")
    return "\n".join([f"SLO: {slos}, attainment >= {100 * sweep['attainment_target']:g}% "
                      "of requests (latencies in ms)", table(headers, rows), verdict])


def format_scaling(rows: Sequence[dict]) -> str:
    body = []
    for r in rows:
        if r.get("error"):
            body.append([r["config"], r["gpus"], f"failed: {r['error']}", "", "", "", ""])
            continue
        body.append([r["config"], r["gpus"], r["prefill_throughput"], r["decode_throughput"],
                     r["itl_p95_ms"], r["ttft_p95_ms"], r["scaling_efficiency"]])
    return table(["Config", "GPUs", "Prefill tok/s", "Decode tok/s", "ITL p95 (ms)",
                  "TTFT p95 (ms)", "Scaling (measured/ideal)"], body)
