"""GPU check: is the CUDA path right, and how close to the hardware does it run? One script, under
10 minutes on one NVIDIA GPU:

    python benchmarks/gpu_check.py [--json gpu_check.json] [--keep-going] [--enforce-eager]

Four sections, each in a process of its own with a timeout (a sticky CUDA error or a hang ends that
section alone), the JSON file rewritten after each one with every section's status (ok, failed,
timeout, not run), its error and the figures it had measured:

1. exactness: the embedded SmolLM2-135M on the GPU in bfloat16 (and in float32, which isolates the
   kernels from bf16 rounding) against the float32 CPU reference: greedy token agreement over the
   first N tokens of each prompt, and teacher-forced next-token log-probability differences (max and
   mean |diff| over the reference's own token sequences) with the share of positions whose most
   likely token is the same.
2. decode (Llama-3.1-8B geometry, dummy bf16 weights, as are 3 and 4): the start-up memory breakdown;
   batch-1 decode time per token against the HBM floor (the bytes of weights a decode step reads /
   measured device copy bandwidth); batch-64 throughput; CUDA graph replays counted over the timed
   steps.
3. prefill: tokens/s over prompt-only steps after a warm-up step.
4. full_load: sequences holding at least 90% of the profiled KV blocks at once; the activation peak
   they reach against the profiled one.
Goals: batch-1 decode within 1.25x of the HBM floor; no out-of-memory in the full load.

Any request that ends with an error fails its section at once, with the engine step's traceback; a
timed step that did not produce one token per sequence fails it too, as does, on CUDA, a decode
step that ran eagerly when graphs were asked for. "completed" is true only when every section
passed. The exit status is 0 only then; by default the first failure stops the run (`--keep-going`
runs the remaining sections anyway).

`--smoke` runs every section on CPU with a tiny random-weight model in well under a minute: it checks
the script, not the GPU. `--fail-section NAME` makes that section's engine fail a step on purpose.
The sections run with MESHSERVE_DISABLE_CPU_KERNELS=1 unless it is set: the CPU reference takes
PyTorch's path rather than wait for the C++ kernels' first build.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = ("exactness", "decode", "prefill", "full_load")
TIMEOUT_S = {"exactness": 180, "decode": 240, "prefill": 180, "full_load": 300}
SMOKE_TIMEOUT_S = 120


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("?")[0] + "?")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt in the exactness check")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (no replays are then required)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the decode section's largest batch")
    ap.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
    ap.add_argument("--full-load-max-model-len", type=int, default=8192)
    ap.add_argument("--full-load-max-num-seqs", type=int, default=128,
                    help="with --full-load-max-model-len, bounds the tokens the full load can place")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--timeout-s", type=float, default=None, help="per section (default: each its own)")
    ap.add_argument("--keep-going", action="store_true", help="run the remaining sections after a failure")
    ap.add_argument("--json", default="gpu_check.json", help="results, rewritten after each section")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script only")
    ap.add_argument("--fail-section", choices=SECTIONS, default=None,
                    help="force an engine step of this section to fail (checks the failure path)")
    # A section's own process: what the parent starts.
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _sections_module():
    sys.path.insert(0, str(HERE))
    import gpu_check_sections
    return gpu_check_sections


def settings_from(args: argparse.Namespace) -> dict:
    """gpu_check_common.Settings' fields, which each section's process reads. This process imports
    neither torch nor meshserve on a smoke run, and on a GPU creates no CUDA context, so that the
    sections profile a device that holds nothing of it."""
    if args.smoke:
        return {"device": "cpu", "smoke": True, "tokens": 4, "max_model_len": 256, "max_num_seqs": 4,
                "decode_steps": 4, "fail_section": args.fail_section}
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a machine with an NVIDIA GPU (or --smoke to check the script)")
    keys = ("tokens", "enforce_eager", "max_model_len", "max_num_seqs", "decode_steps", "full_load_max_model_len",
            "full_load_max_num_seqs", "fail_section")
    return {"device": "cuda", "smoke": False, **{k: getattr(args, k) for k in keys}}


def child_main(args: argparse.Namespace) -> int:
    """One section in this process; exits without the interpreter's teardown, which a device in an
    error state can hang."""
    # On a timeout the parent asks first: finally blocks then run, and a build lock this process
    # holds (torch's C++ extension builds) is released instead of blocking every later build.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    mod = _sections_module()
    settings = mod.Settings(**json.loads(args.settings))
    with tempfile.TemporaryDirectory() as tmp:
        code = mod.run_section(args.section, settings, Path(args.result), Path(tmp))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class SectionProcess:
    """A section's process, its output passed through and its tail kept for the error text."""

    def __init__(self, name: str, settings: dict, result: Path):
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--section", name, "--result", str(result),
               "--settings", json.dumps(settings)]
        # The CPU reference and the smoke run take PyTorch's path: the C++ CPU kernels' first build
        # takes a minute of a section's time on a fresh machine, and they are not what is checked.
        env = {"MESHSERVE_DISABLE_CPU_KERNELS": "1", **os.environ}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # its own group: a timeout ends what it started
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.reader = threading.Thread(target=self._pass_through, daemon=True)
        self.reader.start()

    def _pass_through(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            self.tail.append(line)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None after killing it at the timeout."""
        code: int | None = None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # a timeout, or this process interrupted: nothing of the section outlives it
            if code is None:
                self._stop()
        self.reader.join(5)
        return code

    def _stop(self, grace_s: float = 5.0) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:  # stuck in a device call, which a signal handler waits for
            pass
        with contextlib.suppress(ProcessLookupError):  # the group's other processes, or a child that ignored it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def run_section(name: str, settings: dict, timeout_s: float, workdir: Path) -> tuple[dict, dict]:
    """(the section's entry for the JSON, the device as its process saw it)."""
    result = workdir / f"{name}.json"
    t0 = time.perf_counter()
    proc = SectionProcess(name, settings, result)
    code = proc.wait(timeout_s)
    elapsed = time.perf_counter() - t0
    doc = json.loads(result.read_text()) if result.exists() else {}
    entry = {"status": doc.get("status", "failed"), "elapsed_s": elapsed, **doc.get("figures", {})}
    if code is None:
        entry["status"] = "timeout"
        entry["error"] = f"no result after {timeout_s:.0f} s; the process was killed"
    elif code != 0 or entry["status"] != "ok":
        entry["status"] = "failed"
        entry["error"] = doc.get("error") or f"the process exited with {code} without a result"
    if entry["status"] != "ok":  # what it printed last: the error of a process that died without a result
        entry["summary"] = doc.get("summary") or entry["error"].strip().splitlines()[-1]
        entry["output_tail"] = "".join(proc.tail)
    return entry, doc.get("device_info", {})


def write_json(path: Path, results: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1, default=str))
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section:
        return child_main(args)
    settings = settings_from(args)
    started = time.perf_counter()
    out = Path(args.json)
    results: dict = {"device": settings["device"], "smoke": settings["smoke"], "completed": False,
                     "sections": {name: {"status": "not run"} for name in args.sections}}
    write_json(out, results)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections:
            print(f"\n== {name}", flush=True)
            timeout = args.timeout_s or (SMOKE_TIMEOUT_S if args.smoke else TIMEOUT_S[name])
            entry, device = run_section(name, settings, timeout, Path(tmp))
            results.update({k: v for k, v in device.items() if k not in results})
            results["sections"][name] = entry
            results["completed"] = all(e["status"] == "ok" for e in results["sections"].values())
            results["elapsed_s"] = time.perf_counter() - started
            write_json(out, results)
            if entry["status"] != "ok":
                print(f"\nsection {name}: {entry['status']}: {entry['summary']}", flush=True)
                if not args.keep_going:
                    break
    statuses = ", ".join(f"{n} {e['status']}" for n, e in results["sections"].items())
    print(f"\n{'completed' if results['completed'] else 'NOT completed'} in {results['elapsed_s']:.0f} s "
          f"({statuses}); results in {out}", flush=True)
    return 0 if results["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
