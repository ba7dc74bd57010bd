"""`meshserve bench serve | sweep | compare | scaling`."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable

from meshserve.bench.config import (
    DATASETS,
    ENDPOINTS,
    BenchConfig,
    DatasetConfig,
    LoadConfig,
    parse_csv_floats,
    parse_goodput,
    parse_metric_names,
    parse_rate,
)

DEFAULT_URL = "http://127.0.0.1:8000"


def _add_workload_args(p: argparse.ArgumentParser, *, model_help: str) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    g.add_argument("--model", default=None, help=model_help)
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="count prompt tokens with this HF tokenizer (tokenizer.json or a "
                        "directory) instead of the server's /tokenize")
    g.add_argument("--api-key", default=os.environ.get("MESHSERVE_API_KEY"),
                   help="bearer token (default: $MESHSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take (default 600)")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, metavar="F",
                   help="ShareGPT JSON file, or JSONL with {\"prompt\", \"max_tokens\"} per line")
    g.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="requests to send (default 100; jsonl: every line)")
    g.add_argument("--random-input-len", type=int, default=512, metavar="N",
                   help="prompt tokens (random), suffix tokens (prefix); default 512")
    g.add_argument("--random-output-len", type=int, default=128, metavar="N",
                   help="output tokens (random, prefix); default 128")
    g.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths uniform in [N*(1-R), N*(1+R)], 0 <= R < 1 (default 0)")
    g.add_argument("--prefix-len", type=int, default=256, metavar="N",
                   help="shared prefix tokens of the prefix dataset (default 256)")
    g.add_argument("--num-prefixes", type=int, default=1, metavar="K",
                   help="distinct shared prefixes, used in turn (default 1)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, metavar="N",
                   help="fix ShareGPT output lengths instead of the replies' lengths")
    g.add_argument("--seed", type=int, default=0, help="makes prompts and arrivals reproducible")

    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=str, default="inf", metavar="R|inf",
                   help="mean requests per second; inf sends all at once (default)")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier (default 1)")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                   help="at most C requests in flight")
    g.add_argument("--num-warmups", type=int, default=1, metavar="N",
                   help="untimed requests sent first (default 1)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly max_tokens output tokens (default on)")
    g.add_argument("--temperature", type=float, default=0.0)

    g = p.add_argument_group("metrics and output")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles for (default ttft,tpot,itl,e2el)")
    g.add_argument("--metric-percentiles", default="50,95,99",
                   help="percentiles to report (default 50,95,99)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for request goodput, e.g. ttft:1500 tpot:80 (names ttft, tpot, e2el)")
    g.add_argument("--save-result", action="store_true", help="write the result JSON (and plots)")
    g.add_argument("--result-dir", default="results", metavar="D")
    g.add_argument("--result-filename", default=None, metavar="F")
    g.add_argument("--no-plot", action="store_true", help="with --save-result: skip the PNGs")
    g.add_argument("--label", default=None, help="a name for this run in reports")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    # Not on `bench scaling`: each of its layouts is a different fleet, so one replica count
    # would price most of them wrongly.
    g = p.add_argument_group("cost")
    g.add_argument("--cost-per-replica-hour", type=float, default=None, metavar="PRICE",
                   help="price of one replica for one hour, any currency; adds fleet cost, cost per "
                        "request, per goodput request and per million output tokens")
    g.add_argument("--num-replicas", type=int, default=1, metavar="N",
                   help="replicas paid for during the run, e.g. 2 for 1 prefill + 1 decode "
                        "(default 1)")


def config_from_args(args: argparse.Namespace, base_url: str, model: str | None) -> BenchConfig:
    dataset = DatasetConfig(
        name=args.dataset_name, path=args.dataset_path, num_prompts=args.num_prompts,
        input_len=args.random_input_len, output_len=args.random_output_len,
        range_ratio=args.random_range_ratio, prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes, sharegpt_output_len=args.sharegpt_output_len,
        seed=args.seed)
    load = LoadConfig(request_rate=parse_rate(args.request_rate), burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency)
    return BenchConfig(
        base_url=base_url, endpoint=args.endpoint, model=model, tokenizer=args.tokenizer,
        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
        request_timeout_s=args.request_timeout, num_warmups=args.num_warmups, dataset=dataset,
        load=load, percentile_metrics=parse_metric_names(args.percentile_metrics),
        percentiles=parse_csv_floats(args.metric_percentiles, "--metric-percentiles"),
        goodput=parse_goodput(args.goodput), show_progress=not args.disable_tqdm,
        cost_per_replica_hour=getattr(args, "cost_per_replica_hour", None),
        num_replicas=getattr(args, "num_replicas", 1))


def _result_path(args: argparse.Namespace, kind: str, result: dict) -> str:
    from meshserve.bench.report import result_filename

    return os.path.join(args.result_dir, args.result_filename or result_filename(kind, result))


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Unreachable servers and failed launches are reported in one line, not a traceback."""
    def run(args: argparse.Namespace) -> int:
        import aiohttp

        try:
            return fn(args)
        except (RuntimeError, aiohttp.ClientError, OSError) as exc:
            print(f"meshserve bench {args.bench_command}: error: {exc}", file=sys.stderr)
            return 1
    return run


def cmd_serve(args: argparse.Namespace) -> int:
    from meshserve.bench import plots, report
    from meshserve.bench.runner import run_serve

    config = config_from_args(args, args.base_url, args.model)
    result = run_serve(config, label=args.label)
    print(report.format_result(result))
    if args.save_result:
        path = report.save_json(result, _result_path(args, "serve", result))
        print(f"saved {path}")
        if not args.no_plot:
            print(f"saved {plots.plot_distributions(result, path[:-5] + '-distributions.png')}")
    return 0 if result["completed"] else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    from meshserve.bench import plots, report
    from meshserve.bench.runner import Benchmark
    from meshserve.bench.sweep import SweepConfig, run_sweep

    config = config_from_args(args, args.base_url, args.model)
    if args.request_rates:
        sweep = SweepConfig("rate", parse_csv_floats(args.request_rates, "--request-rates"),
                            args.slo_attainment, args.refine_steps, args.full_curve)
    else:
        sweep = SweepConfig("concurrency", parse_csv_floats(args.concurrencies, "--concurrencies"),
                            args.slo_attainment, args.refine_steps, args.full_curve)
    if not config.goodput:
        raise ValueError("bench sweep needs --goodput SLOs, e.g. --goodput ttft:1500 tpot:80")

    async def go() -> dict:
        async with Benchmark(config) as bench:
            return await run_sweep(bench, sweep,
                                   on_point=lambda p: print(report.format_sweep_point(sweep.kind, p),
                                                            flush=True))

    result = asyncio.run(go())
    print(report.format_sweep(result))
    if args.save_result:
        result["model_id"] = result["points"][0]["result"]["model_id"]
        path = report.save_json(result, _result_path(args, "sweep", result))
        print(f"saved {path}")
        if not args.no_plot:
            png = plots.plot_load_curve(result["points"], path[:-5] + "-load-curve.png",
                                        sweep.label, config.goodput,
                                        result["max_load_meeting_slo"])
            print(f"saved {png}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from meshserve.bench.report import format_compare, load_json

    a, b = load_json(args.a), load_json(args.b)
    for path, r in ((args.a, a), (args.b, b)):
        if "completed" not in r:
            raise ValueError(f"{path!r} is not a `bench serve` result (no 'completed' field)")
    name_a = a.get("label") or os.path.basename(args.a)
    name_b = b.get("label") or os.path.basename(args.b)
    if name_a == name_b:
        name_a, name_b = "A", "B"
    print(format_compare(a, b, name_a, name_b))
    return 0


def cmd_scaling(args: argparse.Namespace) -> int:
    from meshserve.bench import report
    from meshserve.bench.scaling import (
        DEFAULT_LAUNCH,
        ScalingConfig,
        parse_layouts,
        run_scaling,
    )

    config = config_from_args(args, DEFAULT_URL, None)  # each layout gets its own URL
    sc = ScalingConfig(layouts=parse_layouts(args.layouts), model=args.model or "",
                       launch_command=args.launch_command or DEFAULT_LAUNCH, host=args.host,
                       startup_timeout_s=args.startup_timeout,
                       prefill_probe=not args.no_prefill_probe, log_dir=args.log_dir)

    def progress(row: dict) -> None:
        state = f"failed: {row['error']}" if row.get("error") else "done"
        print(f"{row['config']}: {state}", flush=True)

    result = asyncio.run(run_scaling(config, sc, on_row=progress))
    print(report.format_scaling(result["rows"]))
    if args.save_result:
        result["model_id"] = args.model or "default"
        print(f"saved {report.save_json(result, _result_path(args, 'scaling', result))}")
    return 1 if any(r.get("error") for r in result["rows"]) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure a serving endpoint (TTFT, TPOT, ITL, goodput, scaling)",
        description="Serving benchmark against any OpenAI-compatible server.",
        epilog="Example: meshserve bench serve --base-url http://127.0.0.1:8000 "
               "--num-prompts 200 --request-rate 4 --goodput ttft:1500 tpot:80")
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    sub.required = True

    p = sub.add_parser(
        "serve", help="one run at one load", description="Send a request set at a given load "
        "and report latency (TTFT, TPOT, ITL, E2EL), throughput and goodput.",
        epilog="Example: meshserve bench serve --base-url http://127.0.0.1:8000 "
               "--dataset-name random --random-input-len 1024 --random-output-len 128 "
               "--num-prompts 200 --request-rate 4 --metric-percentiles 50,95,99 "
               "--goodput ttft:1500 tpot:80 --save-result")
    p.add_argument("--base-url", default=DEFAULT_URL)
    _add_workload_args(p, model_help="model name in requests (default: the server's first)")
    _add_cost_args(p)
    p.set_defaults(func=_guarded(cmd_serve))

    p = sub.add_parser(
        "sweep", help="ramp the offered load until the goodput SLO fails",
        description="Run the same request set at each request rate (or concurrency) in "
        "increasing order and report the highest load that still meets the goodput SLO.",
        epilog="Example: meshserve bench sweep --base-url http://127.0.0.1:8000 "
               "--request-rates 1,2,4,8,16 --num-prompts 200 --goodput ttft:1500 tpot:80 "
               "--slo-attainment 0.95 --save-result")
    p.add_argument("--base-url", default=DEFAULT_URL)
    loads = p.add_mutually_exclusive_group(required=True)
    loads.add_argument("--request-rates", metavar="R1,R2,...", help="request rates to try (req/s)")
    loads.add_argument("--concurrencies", metavar="C1,C2,...",
                       help="max concurrencies to try (with --request-rate, default inf)")
    p.add_argument("--slo-attainment", type=float, default=0.95, metavar="F",
                   help="fraction of requests that must meet the SLO (default 0.95)")
    p.add_argument("--refine-steps", type=int, default=0, metavar="K",
                   help="bisect K times between the last passing and first failing load")
    p.add_argument("--full-curve", action="store_true",
                   help="run every load even after the SLO has failed")
    _add_workload_args(p, model_help="model name in requests (default: the server's first)")
    _add_cost_args(p)
    p.set_defaults(func=_guarded(cmd_sweep))

    p = sub.add_parser(
        "compare", help="two results side by side with ratios",
        description="Print two `bench serve --save-result` files side by side; the last "
        "column is B/A.",
        epilog="Example: meshserve bench compare results/tp1.json results/tp2.json")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "scaling", help="launch the server in several layouts and print the scaling table",
        description="For each TPxPP[xDP] layout: start the server from --launch-command, wait "
        "for /health, run the workload and a prefill probe, stop the server; then print "
        "prefill and decode throughput, ITL p95, TTFT p95 and scaling efficiency.",
        epilog="Example: meshserve bench scaling --layouts 1x1,2x1,4x1 --num-prompts 100 "
               "--random-input-len 1024 --random-output-len 128 --max-concurrency 16")
    p.add_argument("--layouts", required=True, metavar="TPxPP[xDP],...",
                   help="layouts to launch, e.g. 1x1,2x1,1x2")
    p.add_argument("--launch-command", default=None, metavar="TEMPLATE",
                   help="server command; placeholders {model} {host} {port} {tp} {pp} {dp} "
                        "(default: meshserve serve {model} --port {port} "
                        "--tensor-parallel-size {tp} --pipeline-parallel-size {pp})")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for /health (default 900)")
    p.add_argument("--no-prefill-probe", action="store_true",
                   help="skip the one-output-token run that measures prefill throughput")
    p.add_argument("--log-dir", default=None, metavar="D",
                   help="where server logs go (default: a temporary directory)")
    _add_workload_args(p, model_help="model to launch, substituted for {model} "
                                     "(default: the server's embedded model)")
    p.set_defaults(func=_guarded(cmd_scaling))
