"""benchmarks/disagg.py on CPU: `--quick --json` starts both fleets (two colocated replicas; one prefill
and one decode replica handing KV over tcp), each behind a gateway, calibrates the hand-off on the idle
split pair and runs the same small Poisson mix through both: every fleet completes requests, the split
run's long prompts are handed off, and the calibration finds a positive bandwidth."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "disagg.py"
# A quick run takes about a minute on an idle 2-core machine (two fleets started, six requests each);
# far above that, only a hang fails it.
RUN_TIMEOUT_S = 400


def _run(*flags: str) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *flags], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM, not the SIGKILL of subprocess.run: the script then stops the servers it started
        # (they run in sessions of their own and would outlive it).
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"disagg.py did not finish in {RUN_TIMEOUT_S} s\n{out[-3000:]}{err[-3000:]}") from None
    return proc.returncode, out, err


def test_quick_run_compares_both_fleets_and_calibrates_the_handoff():
    code, out, err = _run("--quick", "--json")
    assert code == 0, out[-3000:] + err[-3000:]
    doc = json.loads(out)
    fleets = doc["fleets"]
    assert set(fleets) == {"colocated", "split"}
    for config in ("colocated", "split"):
        median = fleets[config]["median"]
        assert median["completed"] > 0 and median["failed"] == 0
        assert median["p50_ttft_ms"] > 0 and median["cost_per_request"] > 0
        assert set(median["slo_met"]) == {"long", "short"}
    # The long prompts exceed --disagg-min-tokens and were handed off; the short ones were not split.
    handoffs = doc["handoffs"]
    assert handoffs["outcomes"]["ok"] > 0 and handoffs["outcomes"]["skipped"] > 0
    assert handoffs["count"] == handoffs["outcomes"]["ok"] and handoffs["median_gbs"] > 0
    split_run = fleets["split"]["runs"][0]
    assert all(h["bytes"] > 0 and h["seconds"] > 0 for h in split_run["handoffs"])
    calibration = doc["calibration"]
    assert calibration["bandwidth_gbs"] > 0 and calibration["overhead_ms"] >= 0
    assert len(calibration["points"]) >= 2
    # The planner's prediction for each measured hand-off, as a ratio to it.
    assert handoffs["median_predicted_over_measured"] > 0 and 0 <= handoffs["within_25pct"] <= 1
