"""Plan output: a readable table, a JSON document, and a PNG of memory and latency per layout."""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from .memory import shard_stages
from .params import model_params
from .planner import LayoutPlan, PlanConfig, PlanResult
from .units import GB, GiB


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "inf" if math.isinf(seconds) else f"{seconds * 1e3:,.1f}"


def _num(x: float | None, fmt: str = "{:,.2f}") -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else fmt.format(x)


def _count(n: float) -> str:
    return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def _flops(f: float) -> str:
    return f"{f / 1e12:,.1f} TFLOP/s" if f >= 1e12 else f"{f / 1e9:,.1f} GFLOP/s"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def header(result: PlanResult) -> list[str]:
    c, m, g = result.config, result.config.model, result.config.gpu
    res = c.resolved
    counts = model_params(m)
    dtypes = c.dtypes
    wb = dtypes.stored_bytes(shard_stages(m, counts, 1, 1)[0])
    dtype_names = c.weight_dtype + (f" ({dtypes.embedding} embeddings)" if dtypes.embedding != c.weight_dtype else "")
    kv_tok = next((p.memory.kv_bytes_per_token for p in result.plans if p.memory), 0.0)
    active = (f", {_count(counts.active(m))} active ({m.experts_per_token} of {m.num_experts} experts per "
              f"token)" if m.is_moe else "")
    slo = ", ".join(s for s in (f"TTFT <= {c.slo_ttft_ms:g} ms" if c.slo_ttft_ms else "",
                                f"ITL <= {c.slo_itl_ms:g} ms" if c.slo_itl_ms else "") if s) or "none"
    rate = f"{c.request_rate:g} req/s" if c.request_rate else "not given (ranked by SLO capacity)"
    return [
        f"Model  {m.name} ({m.kind}): {_count(counts.total)} parameters{active}; "
        f"{dtype_names} weights {wb / GB:,.2f} GB = {wb / GiB:,.2f} GiB",
        f"KV     {c.kv_cache_dtype}: {kv_tok:,.0f} bytes/token, {kv_tok * res.max_model_len / GiB:,.3f} GiB "
        f"= {kv_tok * res.max_model_len / GB:,.3f} GB per {res.max_model_len:,}-token sequence",
        f"GPU    {c.num_gpus} x {g.name} ({res.gpus_per_node} per node): {g.memory_bytes / GiB:,.2f} GiB, "
        f"{g.hbm_bandwidth / GB:,.1f} GB/s, {_flops(g.peak_flops(c.weight_dtype))} "
        f"{'measured' if g.measured else f'peak x {res.compute_efficiency:g} achievable'}, "
        f"ridge {g.ridge_point(c.weight_dtype):,.0f} FLOP/byte",
        f"Budget {c.gpu_memory_utilization:g} x memory - {c.runtime_reserve_gib:g} GiB reserve per GPU; "
        f"token mix {res.prompt_len:,} prompt + {res.output_len:,} output; SLO {slo}; rate {rate}",
        "Units  GB = 1e9 bytes, GiB = 2^30 bytes; bandwidths in decimal GB/s",
    ] + _moe_line(c)


def _moe_line(c: PlanConfig) -> list[str]:
    if not c.model.is_moe:
        return []
    skew = f"{c.moe_load_max_to_mean:g} (measured)" if c.moe_load_max_to_mean else "from uniform routing"
    return [f"MoE    EP layouts split whole experts over the TP ranks (EP = TP, the same GPUs: TP x PP x DP "
            f"GPUs in all); all resident experts count in memory; busiest EP rank's load {skew}"]


def format_report(result: PlanResult) -> str:
    shown = result.shown
    mem_rows, time_rows = [], []
    for p in shown:
        m, op = p.memory, p.operating
        rank = str(p.rank) if p.rank else "-"
        mem_cols = [_num(m.weights_per_gpu_bytes / GiB), _num(m.kv_bytes_per_seq_per_gpu / GiB, "{:,.3f}"),
                    _num(m.kv_available_per_gpu_bytes / GiB), _num(m.max_seqs, "{:,}"),
                    _num(m.max_kv_tokens, "{:,}")] if m else [_num(None)] * 5
        mem_rows.append([p.layout.name, p.status, rank, *mem_cols])
        if op:
            parts = p.decode_batch1_parts
            a2a = parts.get("all_to_all_dispatch", 0) + parts.get("all_to_all_combine", 0)
            moe_cols = [_ms(a2a)] if result.config.model.is_moe else []
            time_rows.append([p.layout.name, rank, _ms(p.decode_batch1_s), *moe_cols, _ms(p.prefill_s),
                              _num(op.concurrency, "{:,.1f}"),
                              _num(op.pipeline_utilization * 100, "{:.0f}%"), _ms(op.itl_s),
                              _ms(op.ttft_s), _ms(op.ttft_p50_s),
                              _num(op.tokens_per_s_per_user, "{:,.1f}"),
                              _num(op.tokens_per_s, "{:,.0f}"), _ms(p.kv_handoff_s),
                              _num(p.capacity_rps, "{:,.3f}"), _num(p.goodput_rps, "{:,.3f}"),
                              op.limit or ("ok" if op.meets_slo else "-")])
    out = header(result) + ["", "Memory per GPU (fullest rank), GiB"]
    out.append(_table(["layout", "status", "rank", "weights", "KV/seq", "KV free", "max seqs",
                       "KV tokens"], mem_rows))
    if time_rows:
        out += ["", "Time per replica at the operating point (the request rate, else the SLO capacity)"]
        moe_head = ["of it a2a ms"] if result.config.model.is_moe else []
        out.append(_table(["layout", "rank", "ITL b=1 ms", *moe_head, "prefill ms", "seqs", "PP util",
                           "ITL ms", "TTFT ms", "TTFT p50",
                           "tok/s/user", "tok/s/replica", "KV hand-off ms", "SLO cap req/s",
                           "goodput req/s", "limit"], time_rows))
    c = result.config
    knobs = "".join([
        f"{c.max_num_batched_tokens:,} tokens a step",
        (f", prompts join decodes {c.prefill_chunk_with_decodes:,} tokens at a time"
         if c.prefill_chunk_with_decodes else ""),
        f", {c.serving_overhead_ms:g} ms serving path per TTFT" if c.serving_overhead_ms else "",
        f", {c.token_overhead_ms:g} ms serving path per streamed token" if c.token_overhead_ms else ""])
    for p in shown:
        if (sim := p.simulated) is None:
            continue
        out += ["", f"Simulated at {sim.rate:g} req/s per replica ({p.layout.name}; median of {sim.runs} runs "
                    f"of {sim.num_requests} Poisson requests through the engine's scheduler, {knobs})",
                f"  TTFT p50 / p95 {_ms(sim.ttft_p50_s)} / {_ms(sim.ttft_p95_s)} ms, "
                f"TPOT p50 / p95 {_ms(sim.tpot_p50_s)} / {_ms(sim.tpot_p95_s)} ms, "
                f"{sim.mean_running:,.1f} sequences per step"]
    notes = [f"  {p.layout.name}: {why}" for p in shown for why in p.reasons + p.flags]
    if notes:
        out += ["", "Rejected / flagged"] + notes
    best = result.recommended
    if not best:
        out += ["", "Recommended: none - no layout fits"]
    elif best.goodput_rps > 0:
        out += ["", f"Recommended: {best.layout.name} (highest estimated goodput under the SLO)"]
    else:
        out += ["", f"Recommended: none meets the SLO; closest {best.layout.name} "
                    f"(binding: {best.estimates()[2].limit})"]
    d = result.decision
    agree = ("agrees" if best and d.layout == best.layout else "differs") if d.layout else ""
    out.append(f"Rule of thumb: {d.rule}" + (f" -> {d.layout.name} ({agree})" if d.layout else ""))
    out += [f"Note: {n}" for n in result.config.notes]
    return "\n".join(out)


def _finite(x: object) -> object:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _layout_dict(p: LayoutPlan) -> dict[str, Any]:
    op = p.operating
    return {
        "name": p.layout.name, "tp": p.layout.tp, "pp": p.layout.pp, "dp": p.layout.dp,
        "ep": p.layout.ep_size, "num_gpus": p.layout.num_gpus,
        "status": p.status, "rank": p.rank, "reasons": p.reasons, "flags": p.flags,
        "memory": asdict(p.memory) if p.memory else None,
        "time": None if not op else {
            "decode_step_batch1_ms": _in_ms(p.decode_batch1_s), "prefill_ms": _in_ms(p.prefill_s),
            "decode_step_batch1_parts_ms": {k: v * 1e3 for k, v in p.decode_batch1_parts.items()},
            "kv_handoff_ms": _in_ms(p.kv_handoff_s), "request_rate_per_replica": op.rate,
            "concurrency": op.concurrency, "pipeline_utilization": op.pipeline_utilization,
            "itl_ms": op.itl_s * 1e3, "ttft_ms": op.ttft_s * 1e3,
            "ttft_p50_ms": op.ttft_p50_s * 1e3,
            "queue_ms": op.queue_s * 1e3, "prefill_utilization": op.prefill_utilization,
            "tokens_per_s_per_user": op.tokens_per_s_per_user,
            "tokens_per_s_per_replica": op.tokens_per_s, "meets_slo": op.meets_slo,
            "limit": op.limit},
        "slo_capacity_rps": p.capacity_rps, "goodput_rps": p.goodput_rps,
        "simulated": None if not p.simulated else {
            "request_rate_per_replica": p.simulated.rate, "requests_per_run": p.simulated.num_requests,
            "runs": p.simulated.runs, "ttft_p50_ms": p.simulated.ttft_p50_s * 1e3,
            "ttft_p95_ms": p.simulated.ttft_p95_s * 1e3, "tpot_p50_ms": p.simulated.tpot_p50_s * 1e3,
            "tpot_p95_ms": p.simulated.tpot_p95_s * 1e3, "mean_running": p.simulated.mean_running},
    }


def to_dict(result: PlanResult) -> dict[str, object]:
    """JSON-ready: sizes in bytes, times in ms, rates in requests/s; infinities become null."""
    c = result.config
    counts = model_params(c.model)
    inputs = {k: v for k, v in asdict(c).items() if k not in ("model", "gpu", "notes", "_resolved")}
    inputs["compute_dtype"] = c.resolved.compute_dtype
    best = result.recommended
    doc: dict[str, object] = {
        "model": {**asdict(c.model), "params": counts.total, "active_params": counts.active(c.model),
                  "kind": c.model.kind},
        "gpu": asdict(c.gpu),
        "inputs": inputs,
        "units": {"bytes": "all *_bytes fields", "GB": GB, "GiB": GiB},
        "layouts": [_layout_dict(p) for p in result.shown],
        "recommended": best.layout.name if best else None,
        "rule_of_thumb": {"rule": result.decision.rule,
                          "layout": result.decision.layout.name if result.decision.layout else None},
        "notes": c.notes,
    }
    return {k: _finite(v) for k, v in doc.items()}


def write_plot(result: PlanResult, path: str) -> None:
    """Memory breakdown per GPU (stacked, GiB) and ITL/TTFT per layout (ms, log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result.config
    plans = [(p.layout.name, p.memory, p.operating) for p in result.shown if p.memory]
    names = [name for name, _, _ in plans]
    fig, (ax_mem, ax_t) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(plans) + 4), 4.8))
    weights = [m.weights_per_gpu_bytes / GiB for _, m, _ in plans]
    reserve = [m.reserve_per_gpu_bytes / GiB for _, m, _ in plans]
    kv = [max(0.0, m.kv_available_per_gpu_bytes / GiB) for _, m, _ in plans]
    unused = [(m.memory_per_gpu_bytes - m.usable_per_gpu_bytes) / GiB for _, m, _ in plans]
    bottom = [0.0] * len(plans)
    for label, values in (("weights", weights), ("runtime reserve", reserve), ("KV cache", kv),
                          ("outside utilization", unused)):
        ax_mem.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_mem.axhline(c.gpu.memory_bytes / GiB, color="k", lw=0.8, ls="--", label="GPU memory")
    ax_mem.set_ylabel("GiB per GPU (fullest rank)")
    ax_mem.set_title(f"{c.model.name} on {c.gpu.name}: memory")
    ax_mem.legend(fontsize=8)
    timed = [(name, op) for name, _, op in plans if op and math.isfinite(op.ttft_s)]
    xs = range(len(timed))
    ax_t.bar([x - 0.2 for x in xs], [op.itl_s * 1e3 for _, op in timed], 0.4, label="ITL")
    ax_t.bar([x + 0.2 for x in xs], [op.ttft_s * 1e3 for _, op in timed], 0.4, label="TTFT")
    for slo, style in ((c.slo_itl_ms, ":"), (c.slo_ttft_ms, "--")):
        if slo:
            ax_t.axhline(slo, color="r", lw=0.8, ls=style)
    ax_t.set_xticks(list(xs), [name for name, _ in timed])
    ax_t.set_yscale("log")
    ax_t.set_ylabel("ms (log scale); red lines: SLOs")
    ax_t.set_title("latency at the operating point")
    ax_t.legend(fontsize=8)
    for ax in (ax_mem, ax_t):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
