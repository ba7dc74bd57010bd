"""benchmarks/gpu_check.py on CPU: `--smoke` runs every section (each in its own process) with a tiny
random-weight model; a failure forced in a middle section stops the run with a non-zero exit, the
sections before it kept in the JSON and the later ones not run; and the pieces that keep a section
from reporting what it did not measure: a request that ends with an error, a timed step without
tokens, a decode step that ran eagerly when CUDA graphs were asked for."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshserve.engine.messages import RequestDelta, SampleDelta
from meshserve.worker.cuda_graphs import DecodeGraphInputs, DecodeGraphs
from meshserve.worker.step import SeqStep, StepInput
from meshserve.worker.step_packing import pack_step

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ["exactness", "decode", "prefill", "full_load"]
# Far above what a loaded 2-core machine takes (a smoke run is well under a minute): only a hang fails it.
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def common(request):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # as the script's sections import each other
    request.addfinalizer(lambda: sys.path.remove(str(ROOT / "benchmarks")))
    return importlib.import_module("gpu_check_common")


def _run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return proc, json.loads(out.read_text())


def test_smoke_runs_every_section(tmp_path):
    proc, doc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert doc["completed"] is True and doc["device"] == "cpu" and doc["smoke"] is True
    sections = doc["sections"]
    assert list(sections) == SECTIONS and all(s["status"] == "ok" for s in sections.values())
    exact = sections["exactness"]
    for dtype in ("bfloat16", "float32"):
        tf = exact[dtype]["teacher_forced"]
        assert tf["positions"] > 0 and 0 <= tf["mean_abs_diff"] <= tf["max_abs_diff"]
        assert 0 < exact[dtype]["agreement"] <= 1
    # float32 on the CPU is the reference itself
    assert exact["float32"]["teacher_forced"]["max_abs_diff"] == 0 and exact["float32"]["agreement"] == 1
    decode = sections["decode"]
    for batch in ("batch1", "batch4"):
        assert decode[batch]["step_s"] > 0 and decode[batch]["graph_sizes"] == []  # no graphs on CPU
        assert decode[batch]["graph_replays"] is None
    assert decode["hbm_floor_s_per_token"] > 0 and "goal_met" in decode["batch1"]
    assert sections["prefill"]["prefill_tokens_per_s"] > 0 and sections["prefill"]["prompts"] > 0
    full = sections["full_load"]
    assert full["fill"] >= 0.9 and full["peak_used_blocks"] <= full["profiled_blocks"]
    assert "== full_load" in proc.stdout


def test_a_failure_in_a_middle_section_stops_the_run_and_keeps_the_earlier_results(tmp_path):
    proc, doc = _run(tmp_path, "--fail-section", "decode")
    assert proc.returncode != 0
    sections = doc["sections"]
    assert doc["completed"] is False
    assert sections["exactness"]["status"] == "ok" and "teacher_forced" in sections["exactness"]["bfloat16"]
    failed = sections["decode"]
    assert failed["status"] == "failed"
    assert "a failure forced by --fail-section" in failed["error"]
    assert "finished with an error" in failed["error"] and "Traceback" in failed["error"]  # the engine step's
    assert "startup_s" in failed  # what it measured before failing is kept
    assert sections["prefill"] == {"status": "not run"} and sections["full_load"] == {"status": "not run"}
    assert "== prefill" not in proc.stdout


class ErroringEngine:
    """What LLMEngine does when a step raises: the requests in it finish with "error". This one would
    also report unfinished work for ever, as a step loop that ignores errors would see it."""

    def __init__(self, produce: bool = False):
        self.executor = SimpleNamespace(execute=lambda step: None)
        self.steps, self.produce, self.ids = 0, produce, []

    def add_request(self, rid, prompt, params):
        self.ids.append(rid)
        return list(prompt)

    def has_unfinished_requests(self):
        return True

    def step(self):
        self.steps += 1
        if self.produce:  # a step that produced nothing
            return []
        return [RequestDelta(rid, [SampleDelta(0, "", [], None, "error", None)], True,
                             error="the engine step failed: RuntimeError: CUDA error: an illegal memory access")
                for rid in self.ids]


def test_a_request_that_ends_with_an_error_fails_the_section_at_once(common):
    engine = ErroringEngine()
    timer = common.StepTimer(common.Watched(SimpleNamespace(engine=engine)), vocab=10)
    timer.add(2, 4, 8)
    with pytest.raises(common.SectionFailed, match="illegal memory access"):
        timer.until_all_started()
    assert engine.steps == 1


def test_a_timed_step_without_tokens_is_not_timed(common):
    engine = ErroringEngine(produce=True)
    timer = common.StepTimer(common.Watched(SimpleNamespace(engine=engine)), vocab=10)
    timer.add(1, 4, 8)
    with pytest.raises(common.SectionFailed, match="produced 0 tokens for 1 sequences"):
        timer.timed(4, 1)
    assert engine.steps == 1


def test_a_failing_engine_step_keeps_its_traceback(common, tmp_path, monkeypatch):
    """A real engine on the tiny model, its second step made to raise: the section's error carries
    the step's traceback, which the engine itself logs only at DEBUG."""
    monkeypatch.setenv("MESHSERVE_DISABLE_CPU_KERNELS", "1")  # as the smoke run: no build to wait for
    settings = common.Settings(device="cpu", smoke=True, fail_section="decode")
    run = common.Run("decode", settings, tmp_path, lambda: None, {})
    watched = run.big_engine(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_memory_bytes=1 << 20)
    timer = common.StepTimer(watched, vocab=common.TINY["vocab_size"])
    timer.add(2, 8, 8)
    timer.until_all_started()  # the first step is the prefill, which passes
    with pytest.raises(common.SectionFailed) as failure:
        timer.finish()
    assert "Traceback" in str(failure.value) and "a failure forced by --fail-section" in str(failure.value)
    watched.close()


def _graph_run(common, device: str, enforce_eager: bool = False):
    settings = common.Settings(device=device, smoke=False, enforce_eager=enforce_eager)
    return common.Run("decode", settings, Path("."), lambda: None, {})


def test_decode_steps_that_ran_eagerly_fail_on_cuda_only(common):
    def runner(sizes, replays):
        return SimpleNamespace(graph_sizes=sizes, graphs=None if replays is None else SimpleNamespace(replays=replays))

    cuda = _graph_run(common, "cuda")
    assert common.check_graphs(cuda, runner([1, 2], 40), 8, 32)["graph_replays"] == 32
    with pytest.raises(common.SectionFailed, match="31 CUDA graph replays for 32"):
        common.check_graphs(cuda, runner([1, 2], 39), 8, 32)
    with pytest.raises(common.SectionFailed, match="ran eagerly"):
        common.check_graphs(cuda, runner([], None), 0, 32)
    # Asked to run eagerly, or on a CPU: counted, never required.
    assert common.check_graphs(_graph_run(common, "cuda", True), runner([], None), 0, 32)["graph_replays"] is None
    assert common.check_graphs(_graph_run(common, "cpu"), runner([], None), 0, 32)["graph_sizes"] == []


def test_the_replay_counter_counts_each_replayed_step():
    class Stand:  # a capture that reruns the function
        def capture(self, fn):
            self.fn = fn
            return fn()

        def replay(self):
            self.fn()

    backend = SimpleNamespace(decode_graph_metadata=lambda slots, tables, lens: None)
    inputs = DecodeGraphInputs(2, 4, pad_block=9, block_size=4, device=torch.device("cpu"))
    graphs = DecodeGraphs(lambda ids, positions, caches, meta, hidden=None: torch.zeros(len(ids), 3), [], inputs,
                          [1, 2], backend, new_capture=Stand)
    graphs.capture()
    step = pack_step(StepInput([SeqStep(0, [5], 3, [0], sample=True)]), 4)
    for _ in range(3):
        graphs.run(step)
    assert graphs.replays == 3


def test_the_full_load_plan_takes_over_90_percent_of_the_blocks(common):
    sections = importlib.import_module("gpu_check_sections")
    for num_blocks, max_len, max_seqs in ((64, 256, 8), (48_000, 8192, 128), (1000, 1024, 4)):
        lengths, new_tokens = sections.fill_plan(num_blocks, 16, max_len, max_seqs, 8192)
        assert all(new_tokens + 1 < n <= max_len for n in lengths) and len(lengths) <= max_seqs
        enough = max_seqs * max_len // 16 >= 0.9 * num_blocks
        assert (sum(lengths) // 16 >= 0.9 * num_blocks) == enough
