"""benchmarks/serving_latency.py end to end on a small load: the script that produces the README's
latency table starts the server, runs every load with prompts of its own, and prints the planner's
prediction beside the measurement."""
import asyncio
import json

from benchmarks import serving_latency

from .helpers import fake_server


def test_latency_table_has_every_load_and_the_planner_column(tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert serving_latency.main(["--rates", "4", "--num-prompts", "3", "--burst-prompts", "3",
                                 "--input-len", "24", "--output-len", "4", "--no-sweep",
                                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 4 req/s, 3 prompts | meshserve |" in table
    assert "| all at once, 3 prompts | meshserve |" in table
    assert "planner at 4 req/s: TTFT p50" in table
    doc = json.loads(out.read_text())
    rows = doc["engines"][0]["rows"]
    assert [r["rate"] for r in rows[:1]] == [4.0] and all(r["completed"] == 3 for r in rows)
    sim = doc["planner"]["4.0"]
    assert sim["num_requests"] == 3
    assert 0 < sim["ttft_p50_s"] <= sim["ttft_p95_s"] < 10 and 0 < sim["tpot_p50_s"] <= sim["tpot_p95_s"] < 10


def test_the_engines_sweep_in_turns_point_by_point(capsys):
    """Two servers, one with a single seat: at 50 req/s its requests queue past the TTFT SLO while
    the other's do not. The sweeps take turns (the order alternating), and each finds its own answer."""
    flags = ("smollm2", "--ttft-ms", "40", "--itl-ms", "20")
    with fake_server(*flags, "--max-num-seqs", "1") as one_seat, fake_server(*flags, "--max-num-seqs", "8") as eight:
        a = serving_latency.parse_args(["--num-prompts", "6", "--input-len", "16", "--output-len", "4",
                                        "--sweep-rates", "2,50", "--slo-ttft-ms", "300", "--slo-tpot-ms", "1000"])
        engines = [serving_latency.Engine("one-seat", []), serving_latency.Engine("eight-seats", [])]
        asyncio.run(serving_latency.sweep_in_turns(a, list(zip(engines, [one_seat, eight]))))
    turns = [line.split()[0] for line in capsys.readouterr().err.splitlines() if " sweep at " in line]
    assert turns[:4] == ["one-seat", "eight-seats", "eight-seats", "one-seat"]
    assert turns[4:] == ["one-seat"] * len(turns[4:])  # only the one that failed a point bisects
    assert engines[1].sweep["max_load_meeting_slo"] == 50
    assert 2 <= engines[0].sweep["max_load_meeting_slo"] < 50
    assert [p["load"] for p in engines[1].sweep["points"]] == [2, 50]
