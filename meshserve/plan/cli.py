"""`meshserve plan`: size a deployment and say which layout meets the SLO."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .calibration import Calibration, load_calibration
from .units import GGUF_DTYPES, KV_DTYPES, WEIGHT_BLOCK_TYPES, WEIGHT_DTYPES

EPILOG = """examples:
  meshserve plan --model Qwen2.5-72B --gpu A100-80GB --gpu-memory-gib 80 --num-gpus 4 \\
      --tensor-parallel-size 4 --runtime-reserve-gib 8 --max-model-len 8192
  meshserve plan --model Llama-3.3-70B --gpu H100-SXM --num-gpus 8 --weight-dtype fp8 \\
      --slo-ttft-ms 1500 --slo-itl-ms 80 --request-rate 2 --plot plan.png
  meshserve plan --calibrate --model SmolLM2-135M --weight-dtype fp32
  meshserve plan --gpu this-machine --model SmolLM2-135M --weight-dtype q4_1 --embedding-dtype q8_0
  meshserve plan --list-models | --list-gpus
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan", help="size a deployment: memory, latency and goodput per TP x PP x DP layout",
        description="Capacity planner: for a model and a GPU count, evaluate every tensor x "
        "pipeline x data parallel layout (or the one given) - weights and KV cache per GPU, "
        "decode and prefill time, and goodput under the SLO - and recommend one.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", help="catalog name (see --list-models), a config.json, or a directory with one")
    a("--gpu", help="catalog GPU (see --list-gpus) or 'this-machine' (needs --calibrate once)")
    a("--gpu-memory-gib", type=float, help="override the GPU's memory, in GiB")
    a("--num-gpus", type=int, default=1, help="GPUs in the deployment (default 1)")
    a("--gpus-per-node", type=int, help="GPUs per node (default: the GPU's usual 8)")
    a("--tensor-parallel-size", type=int, help="evaluate only layouts with this TP")
    a("--pipeline-parallel-size", type=int, help="evaluate only layouts with this PP")
    a("--weight-dtype", choices=WEIGHT_DTYPES, default="bf16",
      help="the linear layers' storage: bf16, fp16, fp32; int8 and fp8 (1 byte + a float32 scale per output "
           "row, as --quantization int8|fp8 stores them); the GGUF block types " + ", ".join(GGUF_DTYPES) +
           " (bytes per value from the engine's block formats); int4 (a generic 4-bit, the packed nibble only)")
    a("--embedding-dtype", choices=("auto", *WEIGHT_DTYPES), default="auto",
      help="the token embedding's and LM head's storage; auto: the weight dtype for GGUF types (a file's "
           "token_embd is often q8_0 or q6_k: say so), else the compute dtype (bf16 on a GPU, fp32 on a CPU)")
    a("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
      help="auto: the weight dtype if 16/32-bit, else bf16")
    a("--max-model-len", type=int, help="context per sequence (default min(8192, model's))")
    a("--prompt-len", type=int, help="prompt tokens per request (default 3/4 of the context)")
    a("--output-len", type=int, help="output tokens per request (default the rest)")
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--runtime-reserve-gib", type=float, default=2.0,
      help="per GPU, for activations, buffers and graphs (default 2)")
    a("--kv-transfer-bandwidth-gbs", type=float,
      help="prefill->decode KV hand-off bandwidth, GB/s (default: the replica's NICs together)")
    a("--kv-transfer-overhead-ms", type=float, default=5.0, help="fixed hand-off overhead")
    a("--slo-ttft-ms", type=float, help="time-to-first-token target")
    a("--slo-itl-ms", type=float, help="inter-token latency target")
    a("--request-rate", type=float, help="offered load, requests/s, for the whole deployment; the "
      "recommended layout's TTFT and TPOT percentiles at it are simulated step by step")
    a("--simulate-requests", type=int, default=200,
      help="requests per simulated run at --request-rate (default 200; the median of 16 runs is shown)")
    a("--serving-overhead-ms", type=float, default=0.0,
      help="a request's time outside the engine's steps (HTTP front end, tokenization, the hops to and "
           "from the engine, streaming the first token), added to the simulated TTFT (default 0; "
           "benchmarks/serving_latency.py measures it)")
    a("--token-overhead-ms", type=float, default=0.0,
      help="the time each streamed token's serving path (front end, clients) takes from the engine's "
           "steps when they share its CPU cores, added to every simulated step per token it emits "
           "(default 0; benchmarks/serving_latency.py measures it on a CPU)")
    a("--max-num-batched-tokens", type=int, default=2048,
      help="the simulated engine's token budget per step, as `meshserve serve` takes it (default 2048)")
    a("--prefill-chunk-with-decodes", type=int, default=None, metavar="N",
      help="the simulated engine's cap on prompt tokens joining a step with decodes, as `meshserve serve` "
           "takes it (0: none; default: the engine's, 256 on a calibrated CPU, none on a GPU)")
    a("--compute-efficiency", type=float,
      help="achievable fraction of peak FLOP/s (default 0.7, 1.0 when measured)")
    a("--bandwidth-efficiency", type=float, default=1.0,
      help="achievable fraction of memory bandwidth (default 1.0: a lower bound on time)")
    a("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
      help="MoE models: only layouts with (or, with --no-..., without) expert parallelism "
           "(EP = TP, the same GPUs); default: rank both")
    a("--moe-load-max-to-mean", type=float,
      help="busiest expert-parallel rank's load over the mean, as measured "
           "(meshserve:moe_rank_load_max_to_mean); default: what uniform routing gives")
    a("--json", action="store_true", help="print the plan as JSON")
    a("--plot", metavar="FILE", help="write a PNG of memory and latency per layout")
    a("--calibrate", action="store_true",
      help="measure this machine, cache it, and plan with the measured constants")
    a("--calibration-file",
      help="calibration JSON (default: calibration.json in $MESHSERVE_CACHE_DIR or ~/.cache/meshserve)")
    a("--list-models", action="store_true", help="list catalog models")
    a("--list-gpus", action="store_true", help="list catalog GPUs")
    p.set_defaults(func=run)


def _list_models() -> str:
    from .catalog import MODELS
    from .params import model_params

    rows = [f"{'name':16s} {'kind':8s} {'params':>9s} {'layers':>6s} {'heads/kv':>8s} {'context':>8s}  hf id"]
    for m in MODELS.values():
        rows.append(f"{m.name:16s} {m.kind:8s} {model_params(m).total / 1e9:8.2f}B {m.num_layers:6d} "
                    f"{m.num_attention_heads:>3d}/{m.num_kv_heads:<4d} {m.max_context:8d}  {m.hf_id}")
    return "\n".join(rows)


def _list_gpus() -> str:
    from .catalog import GPUS, THIS_MACHINE

    lines = [g.describe() for g in GPUS.values()]
    return "\n".join(lines + [f"{THIS_MACHINE}: measured by `meshserve plan --calibrate`"])


# The quantized GEMV's formats a calibration measures besides the plan's own (the CPU kernel reads
# the GGUF blocks and int8 rows, not fp8).
CALIBRATED_QUANT_FORMATS = ("Q4_1", "Q8_0", "INT8_ROWS")


def quant_formats_to_measure(*dtypes: str) -> list[str]:
    """The block formats of the plan's dtypes the CPU kernel reads, then Q8_0 and int8 rows (Q4_1 too
    when the plan names no GGUF format)."""
    named = [t.name for d in dtypes if (t := WEIGHT_BLOCK_TYPES.get(d)) is not None and t.name != "FP8_E4M3_ROWS"]
    gguf = any(d in GGUF_DTYPES for d in dtypes)
    defaults = [f for f in CALIBRATED_QUANT_FORMATS if f != "Q4_1" or not gguf]
    return list(dict.fromkeys(named + defaults))


def _calibrate(path: str | None, cpu_dtype: str, quant_formats: list[str]) -> tuple[Calibration, Path]:
    """Measure this machine in a child process (`meshserve.calibration`: torch and the engine's
    kernels), then read what it wrote."""
    argv = [sys.executable, "-m", "meshserve.calibration", "--cpu-dtype", cpu_dtype,
            "--quant-formats", ",".join(quant_formats)]
    if path:
        argv += ["--calibration-file", str(path)]
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise ValueError(f"the calibration failed (exit code {done.returncode}; its error is above)")
    written = Path(done.stdout.strip().splitlines()[-1])
    return load_calibration(written), written


def run(args: argparse.Namespace) -> int:
    from .catalog import THIS_MACHINE, get_gpu, get_model, gpu_names

    if args.list_models or args.list_gpus:
        print(_list_models() if args.list_models else _list_gpus())
        return 0
    log = sys.stderr if args.json else sys.stdout
    if args.calibrate:
        if args.gpu and args.gpu.lower() != THIS_MACHINE:
            raise ValueError(f"--calibrate plans for this machine; drop --gpu {args.gpu}")
        # On a CPU, measure in the dtype the plan's weights have (bf16 runs on AMX where there is one).
        cal, path = _calibrate(args.calibration_file, "bfloat16" if args.weight_dtype == "bf16" else "float32",
                               quant_formats_to_measure(args.weight_dtype, args.embedding_dtype))
        gpu = cal.to_gpu_spec()
        quant = "".join(f", {name} GEMV {rates[0][1] / 1e9:,.1f} GB/s"
                        for name, rates in (cal.quant_gemv_rates or {}).items())
        print(f"calibrated {cal.device}: matmul {cal.matmul_flops / 1e9:,.1f} GFLOP/s "
              f"({cal.matmul_dtype}), memory {cal.memory_bandwidth / 1e9:,.1f} GB/s{quant}, all-reduce "
              f"alpha {cal.allreduce_latency_s * 1e6:,.1f} us beta {cal.allreduce_bandwidth / 1e9:,.2f} "
              f"GB/s -> {path}", file=log)
        if not args.model:
            return 0
    elif not args.gpu:
        raise ValueError(f"--gpu is required; valid: {', '.join(gpu_names())}")
    else:
        gpu = get_gpu(args.gpu, args.calibration_file)
    if not args.model:
        raise ValueError("--model is required (a catalog name, see --list-models, or a config.json)")

    from .planner import PlanConfig, plan
    from .report import format_report, to_dict, write_plot

    result = plan(PlanConfig(
        model=get_model(args.model), gpu=gpu, num_gpus=args.num_gpus,
        gpus_per_node=args.gpus_per_node, tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, weight_dtype=args.weight_dtype,
        embedding_dtype=args.embedding_dtype,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
        prompt_len=args.prompt_len, output_len=args.output_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        runtime_reserve_gib=args.runtime_reserve_gib, gpu_memory_gib=args.gpu_memory_gib,
        kv_transfer_bandwidth_gbs=args.kv_transfer_bandwidth_gbs,
        kv_transfer_overhead_ms=args.kv_transfer_overhead_ms, slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms, request_rate=args.request_rate,
        compute_efficiency=args.compute_efficiency, bandwidth_efficiency=args.bandwidth_efficiency,
        enable_expert_parallel=args.enable_expert_parallel, moe_load_max_to_mean=args.moe_load_max_to_mean,
        simulate_requests=args.simulate_requests, serving_overhead_ms=args.serving_overhead_ms,
        token_overhead_ms=args.token_overhead_ms,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_with_decodes=args.prefill_chunk_with_decodes))
    print(json.dumps(to_dict(result), indent=2) if args.json else format_report(result))
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=log)
    return 0 if result.recommended else 1
