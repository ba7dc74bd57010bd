"""PNG plots: latency and TPOT distributions of one run, latency against offered load."""
from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np

from meshserve.bench.metrics import percentile_key
from meshserve.bench.report import TITLES


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_distributions(result: dict, path: str) -> str:
    """Histograms of per-request TTFT and TPOT, with the run's percentiles marked."""
    plt = _pyplot()
    per = result["per_request"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("ttft", "tpot")):
        values = np.array([v for v in per[f"{name}_s"] if v is not None], dtype=float) * 1000
        ax.set_title(TITLES[name][0])
        ax.set_xlabel(f"{TITLES[name][1]} (ms)")
        ax.set_ylabel("requests")
        if values.size == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(5, values.size // 4)), color="tab:blue", alpha=0.75)
        for p, style in zip(result.get("metric_percentiles", []), ("--", "-.", ":", "-")):
            v = float(np.percentile(values, p))
            ax.axvline(v, color="black", linestyle=style, linewidth=1,
                       label=f"{percentile_key(p)} {v:.1f} ms")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result.get('model_id')}: rate {result.get('request_rate')}, "
                 f"max concurrency {result.get('max_concurrency') or 'none'}, "
                 f"{result['completed']} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_load_curve(points: Sequence[dict], path: str, load_label: str,
                    slos_ms: dict[str, float] | None = None, best: float | None = None) -> str:
    """Latency percentiles, throughput and SLO attainment against offered load.
    `points` are sweep points: {"load": x, "result": <run result>}; `best`, the highest
    load meeting the SLO, is marked with a vertical green line on every panel."""
    plt = _pyplot()
    slos_ms = slos_ms or {}
    pts = sorted(points, key=lambda p: p["load"])
    x = [p["load"] for p in pts]
    percentiles = pts[0]["result"].get("metric_percentiles", [50, 95, 99]) if pts else []
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el")):
        for p in percentiles:
            key = f"{percentile_key(p)}_{name}_ms"
            ys = [pt["result"].get(key) for pt in pts]
            ys = [np.nan if y is None else y for y in ys]
            ax.plot(x, ys, marker="o", label=percentile_key(p))
        if name in slos_ms:
            ax.axhline(slos_ms[name], color="red", linestyle="--", label=f"SLO {slos_ms[name]:g} ms")
        ax.set_title(TITLES[name][0], fontsize=10)
        ax.set_xlabel(load_label)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    ax = axes.flat[4]
    ax.plot(x, [pt["result"]["request_throughput"] for pt in pts], marker="o", label="completed")
    if all("request_goodput" in pt["result"] for pt in pts):
        ax.plot(x, [pt["result"]["request_goodput"] for pt in pts], marker="s", label="goodput")
    ax.set_title("Throughput", fontsize=10)
    ax.set_xlabel(load_label)
    ax.set_ylabel("req/s")
    ax.legend(fontsize=8)
    ax = axes.flat[5]
    ax.plot(x, [100.0 * pt["result"].get("slo_attainment", np.nan) for pt in pts], marker="o")
    if pts and "attainment_target" in pts[0]:
        ax.axhline(100.0 * pts[0]["attainment_target"], color="red", linestyle="--",
                   label="target")
        ax.legend(fontsize=8)
    ax.set_ylim(0, 105)
    ax.set_title("SLO attainment", fontsize=10)
    ax.set_xlabel(load_label)
    ax.set_ylabel("% of requests")
    if best is not None:
        for ax in axes.flat:
            ax.axvline(best, color="green", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
