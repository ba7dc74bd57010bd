"""benchmarks/serving_latency.py end to end on a small load: the script that produces the README's
latency table starts the server, runs every load with prompts of its own, and prints the planner's
prediction beside the measurement."""
import json

from benchmarks import serving_latency


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
