"""The scaling table: launch in each layout, measure, and always stop what was launched."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import pytest

from meshserve.bench.config import BenchConfig, DatasetConfig
from meshserve.bench.scaling import (
    DEFAULT_LAUNCH,
    Layout,
    ScalingConfig,
    add_efficiency,
    launch_argv,
    parse_layouts,
    run_scaling,
)

from .helpers import FAKE_SERVER, run_bench

# TP=1: 150 ms to the first token, then 100 ms a token (TP=2: half). Delays this long keep the
# machine's own overhead (a few ms a token, tens of ms a run when it is busy) small beside what the
# table compares: the TP=2 run's ITL is 50 ms shorter, and its whole run 650 ms shorter.
TEMPLATE = (f"{sys.executable} {FAKE_SERVER} {{model}} --port {{port}} "
            "--tensor-parallel-size {tp} --pipeline-parallel-size {pp} --ttft-ms 150 --itl-ms 100")


def assert_stopped(pid: int, url: str) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    host, port = url.rsplit("/", 1)[-1].split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
        pass


def test_parse_layouts():
    assert parse_layouts("1x1, 2x1,1x2x4") == (Layout(1, 1), Layout(2, 1), Layout(1, 2, 4))
    assert Layout(2, 2, 2).gpus == 8 and Layout(2, 1).label == "TP=2 PP=1"
    for bad in ("2", "2x", "0x1", "axb"):
        with pytest.raises(ValueError):
            parse_layouts(bad)


def test_launch_template():
    assert launch_argv("serve {model} --port {port} --tp {tp} --pp {pp}", Layout(2, 1),
                       "my model", "127.0.0.1", 9000) == \
        ["serve", "my model", "--port", "9000", "--tp", "2", "--pp", "1"]
    assert launch_argv("serve {model} --port {port}", Layout(1), "", "h", 1) == \
        ["serve", "--port", "1"]
    with pytest.raises(ValueError, match="placeholder"):
        launch_argv("serve --gpus {gpus}", Layout(1), "", "h", 1)
    with pytest.raises(ValueError, match="no {dp}"):
        launch_argv("serve --port {port}", Layout(1, 1, 2), "", "h", 1)
    default = launch_argv(DEFAULT_LAUNCH, Layout(2, 1, 2), "m.gguf", "h", 7)
    assert default == ["meshserve", "serve", "m.gguf", "--port", "7", "--tensor-parallel-size",
                       "2", "--pipeline-parallel-size", "1", "--data-parallel-size", "2"]
    assert "--data-parallel-size" not in launch_argv(DEFAULT_LAUNCH, Layout(2), "", "h", 7)


def test_efficiency_is_relative_to_the_first_layout_that_ran():
    rows = [{"gpus": 1, "error": "boom"}, {"gpus": 1, "decode_throughput": 100.0},
            {"gpus": 2, "decode_throughput": 150.0}, {"gpus": 4, "decode_throughput": 400.0}]
    add_efficiency(rows)
    assert [r["scaling_efficiency"] for r in rows] == [None, 1.0, 0.75, 1.0]


def test_scaling_table_against_a_fake_server(tmp_path, capsys):
    rc = run_bench(["scaling", "--layouts", "1x1,2x1", "--launch-command", TEMPLATE,
                    "--model", "tiny", "--num-prompts", "6", "--random-input-len", "32",
                    "--random-output-len", "6", "--max-concurrency", "3", "--num-warmups", "0",
                    "--disable-tqdm", "--log-dir", str(tmp_path), "--save-result",
                    "--result-dir", str(tmp_path), "--result-filename", "scaling.json"])
    assert rc == 0
    out = capsys.readouterr().out
    for column in ("Prefill tok/s", "Decode tok/s", "ITL p95 (ms)", "TTFT p95 (ms)",
                   "Scaling (measured/ideal)", "TP=2 PP=1"):
        assert column in out
    rows = json.loads((tmp_path / "scaling.json").read_text())["rows"]
    one, two = rows
    assert "--tensor-parallel-size 2" in two["command"] and "tiny" in two["command"]
    assert two["result"]["model_id"] == "tiny"
    assert one["result"]["completed"] == two["result"]["completed"] == 6
    assert one["prefill_throughput"] > 0 and two["prefill_throughput"] > 0
    # The fake server with TP=2 runs twice as fast on twice the GPUs: efficiency near 1.
    assert one["scaling_efficiency"] == 1.0
    assert two["decode_throughput"] > 1.4 * one["decode_throughput"]
    assert 0.7 < two["scaling_efficiency"] < 1.15
    assert two["itl_p95_ms"] < one["itl_p95_ms"]
    for row in rows:
        assert_stopped(row["server_pid"], row["result"]["base_url"])
        assert os.path.exists(row["log"])


def test_failed_launches_are_reported_and_stopped(tmp_path):
    cfg = BenchConfig(show_progress=False, num_warmups=0, dataset=DatasetConfig(num_prompts=2))
    never_ready = ScalingConfig(layouts=(Layout(1),), launch_command=TEMPLATE + " --startup-delay 60",
                                startup_timeout_s=1.0, log_dir=str(tmp_path))
    crashes = ScalingConfig(layouts=(Layout(1),), log_dir=str(tmp_path),
                            launch_command=f"{sys.executable} -c 'print(\"no GPU\"); exit(3)' {{port}}")
    slow = asyncio.run(run_scaling(cfg, never_ready))["rows"][0]
    assert "did not answer 200 within 1 s" in slow["error"]
    with pytest.raises(ProcessLookupError):
        os.kill(slow["server_pid"], 0)
    crashed = asyncio.run(run_scaling(cfg, crashes))["rows"][0]
    assert "exited with code 3" in crashed["error"] and "no GPU" in crashed["error"]
    assert crashed["scaling_efficiency"] is None
