"""The sections of benchmarks/gpu_check.py. Each runs in a process of its own (`gpu_check.py
--section NAME`), records its figures as it goes and ends at the first thing that makes a figure
meaningless: a request that finished with an error, a timed step that produced other than one token
per sequence, a decode step that ran eagerly when CUDA graphs were asked for, a full load that did
not fill the KV cache."""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_check_common import (
    PROMPTS,
    TINY,
    Run,
    SectionFailed,
    Settings,
    StepTimer,
    check_graphs,
    free_device_memory,
    graph_replays,
)

from meshserve.calibration.measure import measure_memory_bandwidth
from meshserve.config import EngineConfig
from meshserve.eval.perplexity import load_runner, next_token_logprobs

FULL_LOAD_FILL = 0.9  # of the profiled KV blocks, at the least
DECODE_GOAL = 1.25  # batch-1 decode time per token / the HBM floor


# ---- exactness ---------------------------------------------------------------------------
def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Tokens each prompt keeps in common with the reference before the first difference."""
    prefixes = []
    for ref, got in zip(reference, other):
        same = 0
        while same < min(len(ref), len(got)) and ref[same] == got[same]:
            same += 1
        prefixes.append(same)
    n = len(reference[0])
    return {"tokens_per_prompt": n, "matching_prefix": prefixes,
            "agreement": sum(prefixes) / (n * len(prefixes)),
            "identical_prompts": sum(p == n for p in prefixes), "prompts": len(prefixes)}


def teacher_forced(model: str, device: str, dtype: str, sequences: list[list[int]], **config) -> list[torch.Tensor]:
    """Per sequence, [len - 1, vocab] float32 log-probabilities of each next token given the
    sequence's own prefix (the same tokens for every configuration, whatever it would sample)."""
    max_len = max(len(s) for s in sequences)
    runner = load_runner(EngineConfig(model=model, device=device, dtype=dtype, enforce_eager=True,
                                      max_model_len=max_len, **config), max_len)
    out = [next_token_logprobs(runner, seq)[:-1].float().cpu() for seq in sequences]
    del runner
    free_device_memory()
    return out


def logprob_differences(got: list[torch.Tensor], reference: list[torch.Tensor], sequences: list[list[int]]) -> dict:
    diffs, same_top = [], []
    for lp, ref, seq in zip(got, reference, sequences):
        nxt = torch.tensor(seq[1:])[:, None]
        diffs.append((lp.gather(1, nxt) - ref.gather(1, nxt)).abs().squeeze(1))
        same_top.append(lp.argmax(-1) == ref.argmax(-1))
    d, top = torch.cat(diffs), torch.cat(same_top).float()
    return {"positions": d.numel(), "max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(),
            "top1_agreement": top.mean().item()}


def exactness(run: Run) -> None:
    s = run.s
    if s.smoke:
        rng = random.Random(1)
        model, config = run.model(TINY), {"load_format": "dummy"}
        prompts: list = [[rng.randrange(TINY["vocab_size"]) for _ in range(8)] for _ in PROMPTS]
    else:
        model, config, prompts = "default", {}, PROMPTS
    # max_num_seqs: every prompt in one batch, and few graph sizes to capture
    common = dict(max_model_len=256, max_num_seqs=16, enable_prefix_caching=False, enforce_eager=s.enforce_eager,
                  **config)
    cpu = run.engine(model, device="cpu", dtype="float32", kv_cache_memory_bytes=64 << 20, **common)
    ref = StepTimer(cpu, 0).generate(prompts, s.tokens)
    cpu.close()
    reference = [tokens for _, tokens in ref]
    sequences = [prompt + tokens for prompt, tokens in ref]
    ref_logprobs = teacher_forced(model, "cpu", "float32", sequences, **config)
    for dtype in ("bfloat16", "float32"):
        watched = run.engine(model, device=s.device, dtype=dtype, **run.kv_args(64 << 20, 0.3), **common)
        got = [tokens for _, tokens in StepTimer(watched, 0).generate(prompts, s.tokens)]
        r = agreement(reference, got)
        r.update(check_graphs(run, watched.runner, 0, None))
        watched.close()
        r["teacher_forced"] = tf = logprob_differences(
            teacher_forced(model, s.device, dtype, sequences, **config), ref_logprobs, sequences)
        run.out[dtype] = r
        run.save()
        print(f"{dtype:>9} on {s.device} vs float32 CPU: {r['agreement']:.1%} of the first {s.tokens} greedy tokens "
              f"agree; {r['identical_prompts']}/{r['prompts']} prompts identical; teacher-forced next-token "
              f"log-probabilities over {tf['positions']} positions: max |diff| {tf['max_abs_diff']:.4f}, mean "
              f"{tf['mean_abs_diff']:.5f}, same top token {tf['top1_agreement']:.1%}", flush=True)


# ---- the Llama-3.1-8B geometry -----------------------------------------------------------
def decode_weight_bytes(runner) -> int:
    """Bytes of weights a decode step reads: all of them but the input embedding, of which it
    reads one row per sequence (the LM head, a separate matrix, is read whole)."""
    return sum(p.numel() * p.element_size() for name, p in runner.model.named_parameters()
               if not name.startswith("embed_tokens."))


def decode(run: Run) -> None:
    s, out = run.s, run.out
    bandwidth = measure_memory_bandwidth(s.device, nbytes=(1 << 30) if run.on_gpu else (64 << 20))
    watched = run.big_engine(max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
                             max_num_batched_tokens=8192, **run.kv_args(16 << 20))
    runner = watched.runner
    out["weight_bytes"] = decode_weight_bytes(runner)
    out["copy_bandwidth_bytes_per_s"] = bandwidth
    out["hbm_floor_s_per_token"] = floor = out["weight_bytes"] / bandwidth
    timer = StepTimer(watched, run.geometry()["vocab_size"])
    prompt_len, warm_up = min(128, s.max_model_len // 2), 4
    for batch in sorted({1, min(64, s.max_num_seqs)}):
        timer.add(batch, prompt_len, 1 + warm_up + s.decode_steps + 8)
        timer.until_all_started()
        timer.timed(warm_up, batch)
        before = graph_replays(runner) or 0
        step_s = statistics.median(timer.timed(s.decode_steps, batch))
        out[f"batch{batch}"] = r = {"step_s": step_s, "tokens_per_s": batch / step_s,
                                    **check_graphs(run, runner, before, s.decode_steps)}
        timer.finish()
        if batch == 1:
            r["floor_ratio"] = ratio = step_s / floor
            r["goal_met"] = ratio <= DECODE_GOAL
            print(f"batch-1 decode: {step_s * 1e3:.2f} ms/token; HBM floor {floor * 1e3:.2f} ms "
                  f"({out['weight_bytes'] / 1e9:.2f} GB of weights / {bandwidth / 1e9:.0f} GB/s copy bandwidth): "
                  f"{ratio:.2f}x the floor (goal <= {DECODE_GOAL}x: {'met' if r['goal_met'] else 'not met'})")
        else:
            print(f"batch-{batch} decode: {batch / step_s:.0f} tokens/s ({step_s * 1e3:.2f} ms per step)")
        print(f"  CUDA graph replays over {s.decode_steps} timed steps: {r['graph_replays']} "
              f"(sizes {r['graph_sizes'] or 'none: eager'})", flush=True)
        run.save()
    watched.close()


def prefill(run: Run) -> None:
    """Steps of prompts alone (max_tokens 1: no decode ever runs beside them), timed after a warm-up
    step of the same shape, which compiles what the first prefill of that shape compiles."""
    s, out = run.s, run.out
    chunk, prompt_len = (256, 64) if s.smoke else (8192, 1024)
    per_step = chunk // prompt_len
    # No graphs: a prompt-only step never replays one, and capturing them would only lengthen the start.
    watched = run.big_engine(max_model_len=max(s.max_model_len, prompt_len + 1), max_num_seqs=2 * per_step,
                             max_num_batched_tokens=chunk, enforce_eager=True, **run.kv_args(16 << 20))
    timer = StepTimer(watched, run.geometry()["vocab_size"])
    for phase, steps in (("warm_up", 1), ("timed", 4 if s.smoke else 8)):
        timer.tokens.clear()
        timer.add(steps * per_step, prompt_len, 1)
        seconds, count = 0.0, 0
        while any(not t for t in timer.tokens.values()):
            seconds += timer._checked_step()[0]
            count += 1
        if any(len(t) != 1 for t in timer.tokens.values()):
            raise SectionFailed("a prefill-only request produced other than one token")
        if phase == "timed":
            tokens = len(timer.tokens) * prompt_len
            out.update(prefill_tokens_per_s=tokens / seconds, prompts=len(timer.tokens), prompt_len=prompt_len,
                       steps=count, step_tokens=chunk, seconds=seconds)
            print(f"prefill: {tokens / seconds:.0f} tokens/s ({len(timer.tokens)} prompts x {prompt_len} tokens "
                  f"in {count} steps of up to {chunk} tokens, after one warm-up step)", flush=True)
    run.save()
    watched.close()


def fill_plan(num_blocks: int, block_size: int, max_model_len: int, max_seqs: int, chunk: int) -> tuple[list[int], int]:
    """(total lengths, new tokens each): sequences that together take about 95% of the blocks (above
    the 90% asked, with room for blocks the scheduler keeps back), each generating for longer than
    the prompts take to prefill, so that the first one is still there when the last one starts."""
    target, per_seq = int(num_blocks * 0.95), max_model_len // block_size
    blocks: list[int] = []
    while target > 0 and len(blocks) < max_seqs:
        blocks.append(min(per_seq, target))
        target -= blocks[-1]
    new_tokens = -(-sum(blocks) * block_size // chunk) + 8
    return [b * block_size for b in blocks if b * block_size > new_tokens + 1], new_tokens


def full_load(run: Run) -> None:
    """Sequences holding at least 90% of the profiled KV blocks at once, and the activation peak
    they reach beside the one the start-up profile measured (what the KV budget was cut from)."""
    s, out = run.s, run.out
    max_len, max_seqs = (256, 8) if s.smoke else (s.full_load_max_model_len, s.full_load_max_num_seqs)
    chunk = 256 if s.smoke else 8192
    watched = run.big_engine(max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=chunk,
                             **run.kv_args(1 << 20))
    engine = watched.engine
    bm = engine.block_manager
    profiled = out["memory"].get("num_blocks", bm.num_blocks)
    lengths, new_tokens = fill_plan(bm.num_blocks, bm.block_size, max_len, max_seqs, chunk)
    timer = StepTimer(watched, run.geometry()["vocab_size"])
    base = 0
    if run.on_gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    for length in lengths:
        timer.add(1, length - new_tokens, new_tokens)
    peak_used, seconds = 0, 0.0
    while engine.has_unfinished_requests():
        seconds += timer.step()[0]
        peak_used = max(peak_used, bm.num_blocks - bm.num_free_blocks)
    out.update(sequences=len(lengths), tokens=sum(lengths), new_tokens_each=new_tokens, seconds=seconds,
               profiled_blocks=profiled, peak_used_blocks=peak_used, fill=peak_used / profiled,
               preemptions=engine.scheduler.num_preemptions)
    if any(len(t) != new_tokens for t in timer.tokens.values()):
        raise SectionFailed(f"not every sequence of the full load got its {new_tokens} tokens")
    if run.on_gpu:
        measured = torch.cuda.max_memory_allocated() - base
        planned = out["memory"]["activation_peak_bytes"]
        out["activation_peak"] = {"measured_bytes": measured, "profiled_bytes": planned,
                                  "ratio": measured / planned if planned else None,
                                  "within_profile": measured <= planned}
        print(f"activation peak under full load {measured / 2**30:.2f} GiB; profiled {planned / 2**30:.2f} GiB",
              flush=True)
    print(f"full load: {len(lengths)} sequences, {sum(lengths)} tokens, peak {peak_used}/{profiled} KV blocks "
          f"({out['fill']:.1%}), {out['preemptions']} preemptions, no out-of-memory", flush=True)
    run.save()
    if out["fill"] < FULL_LOAD_FILL:
        raise SectionFailed(f"the full load took {out['fill']:.1%} of the profiled KV blocks, under "
                            f"{FULL_LOAD_FILL:.0%}: raise --full-load-max-num-seqs or --full-load-max-model-len")
    watched.close()


SECTIONS: dict[str, Callable[[Run], None]] = {
    "exactness": exactness, "decode": decode, "prefill": prefill, "full_load": full_load}


def device_info(device: str) -> dict:
    if device != "cuda":
        return {"torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": props.total_memory / 2**30, "torch": torch.__version__}


def run_section(name: str, settings: Settings, result_path: Path, tmp: Path) -> int:
    """Run one section, writing {status, error, figures} to `result_path` as it goes; the exit code."""
    doc: dict = {"status": "running", "figures": {}, "device_info": device_info(settings.device)}

    def save() -> None:
        partial = result_path.with_suffix(".partial")
        partial.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(partial, result_path)

    save()
    try:
        SECTIONS[name](Run(name, settings, tmp, save, doc["figures"]))
        doc["status"] = "ok"
    except Exception as exc:
        doc["status"], doc["error"] = "failed", "".join(traceback.format_exception(exc))
        doc["summary"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"section {name} failed:\n{doc['error']}", file=sys.stderr, flush=True)
    save()
    return 0 if doc["status"] == "ok" else 1
