"""Scaling table: launch the server in each parallel layout, run one workload, compare.

For each layout the server is started from a command template, the benchmark waits for
`GET /health`, runs the workload (and a prefill probe: the same prompts with one output
token), and the server is stopped whatever happened: SIGTERM to its whole process group,
then SIGKILL after a grace period.

Prefill throughput = prompt tokens / duration of the prefill probe.
Decode throughput  = output tokens / duration of the workload (output token throughput).
Scaling efficiency = (decode throughput / baseline's) / (GPUs / baseline's GPUs), the
baseline being the first layout that ran.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from meshserve.bench import environment
from meshserve.bench.config import METRICS, BenchConfig, LoadConfig
from meshserve.bench.runner import Benchmark
from meshserve.utils.server_process import LaunchedServer, free_port

DEFAULT_LAUNCH = ("meshserve serve {model} --port {port} --tensor-parallel-size {tp} "
                  "--pipeline-parallel-size {pp}")
PLACEHOLDERS = ("model", "host", "port", "tp", "pp", "dp")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"layout {self.tp}x{self.pp}x{self.dp}: sizes must be >= 1")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def label(self) -> str:
        return f"TP={self.tp} PP={self.pp}" + (f" DP={self.dp}" if self.dp > 1 else "")

    @property
    def slug(self) -> str:
        return f"tp{self.tp}-pp{self.pp}-dp{self.dp}"


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """'1x1,2x1,1x2,2x1x2' -> TPxPP[xDP] layouts."""
    layouts = []
    for item in (t.strip() for t in text.split(",")):
        if not re.fullmatch(r"\d+x\d+(x\d+)?", item):
            raise ValueError(f"--layouts item {item!r} must look like TPxPP or TPxPPxDP, e.g. 2x1")
        layouts.append(Layout(*(int(v) for v in item.split("x"))))
    return tuple(layouts)


def launch_argv(template: str, layout: Layout, model: str, host: str, port: int) -> list[str]:
    if layout.dp > 1 and "{dp}" not in template:
        if template != DEFAULT_LAUNCH:
            raise ValueError(f"layout {layout.label} needs data parallelism, but --launch-command "
                             "has no {dp} placeholder")
        # Only then: with DP=1 the default stays a command any server version accepts.
        template += " --data-parallel-size {dp}"
    try:
        text = template.format(model=shlex.quote(model) if model else "", host=host,
                               port=port, tp=layout.tp, pp=layout.pp, dp=layout.dp)
    except (KeyError, IndexError) as exc:
        raise ValueError(f"--launch-command has unknown placeholder {exc}; valid: "
                         + ", ".join("{" + p + "}" for p in PLACEHOLDERS)) from None
    return shlex.split(text)


@dataclass(frozen=True)
class ScalingConfig:
    layouts: tuple[Layout, ...]
    model: str = ""  # what {model} becomes; empty: the server's default model
    launch_command: str = DEFAULT_LAUNCH
    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0
    prefill_probe: bool = True
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("--layouts is empty")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"--startup-timeout {self.startup_timeout_s} must be > 0")


def _slim(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "per_request"}


async def _measure(cfg: BenchConfig, sc: ScalingConfig, layout: Layout, row: dict) -> None:
    port = free_port(sc.host)
    argv = launch_argv(sc.launch_command, layout, sc.model, sc.host, port)
    log_dir = sc.log_dir or tempfile.mkdtemp(prefix="meshserve-scaling-")
    os.makedirs(log_dir, exist_ok=True)
    row.update(command=shlex.join(argv), log=os.path.join(log_dir, f"server-{layout.slug}.log"))
    with LaunchedServer(argv, row["log"], sc.host, port) as server:
        row["server_pid"] = server.pid
        await server.wait_healthy(sc.startup_timeout_s)
        async with Benchmark(dataclasses.replace(cfg, base_url=server.url)) as bench:
            requests = await bench.load_requests()
            result = await bench.run(requests, label=layout.label)
            row.update(decode_throughput=result["output_throughput"],
                       itl_p95_ms=result["p95_itl_ms"], ttft_p95_ms=result["p95_ttft_ms"],
                       result=_slim(result))
            if sc.prefill_probe:
                # A fresh draw: the timed run's prompts are in the prefix cache now.
                probe_requests = [dataclasses.replace(r, output_len=1) for r in await bench.load_requests(1)]
                probe = await bench.run(
                    probe_requests, LoadConfig(math.inf, 1.0, cfg.load.max_concurrency),
                    label=f"{layout.label} prefill probe")
                row.update(prefill_throughput=probe["total_input_tokens"] / probe["duration"],
                           prefill_probe=_slim(probe))


async def run_scaling(cfg: BenchConfig, sc: ScalingConfig,
                      on_row: Callable[[dict], None] = lambda r: None) -> dict:
    # The table needs p95 TTFT and ITL whatever percentiles were asked for.
    cfg = dataclasses.replace(cfg, percentile_metrics=METRICS,
                              percentiles=tuple(sorted(set(cfg.percentiles) | {95.0})))
    rows: list[dict] = []
    for layout in sc.layouts:
        row: dict = {"config": layout.label, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                     "gpus": layout.gpus, "prefill_throughput": None}
        try:
            await _measure(cfg, sc, layout, row)
        except (RuntimeError, aiohttp.ClientError, TimeoutError, OSError) as exc:
            row["error"] = str(exc) or type(exc).__name__
        rows.append(row)
        on_row(row)
    add_efficiency(rows)
    return {"launch_command": sc.launch_command, "model": sc.model, "rows": rows,
            "environment": {"versions": environment.package_versions(),
                            "git": environment.git_state(), "cpu": environment.cpu_info(),
                            "gpu": environment.gpu_info()}}


def add_efficiency(rows: Sequence[dict]) -> None:
    """scaling_efficiency = (throughput / baseline throughput) / (GPUs / baseline GPUs)."""
    ok = [r for r in rows if not r.get("error")]
    for r in rows:
        r["scaling_efficiency"] = None
    if not ok or not ok[0]["decode_throughput"]:
        return
    base = ok[0]
    for r in ok:
        speedup = r["decode_throughput"] / base["decode_throughput"]
        r["scaling_efficiency"] = speedup / (r["gpus"] / base["gpus"])
