"""The planner's step-by-step serving simulation (plan/simulate.py): the engine's scheduling policy
replayed on arrivals, with step times from a stand-in model whose answers can be worked by hand."""
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.cli import main
from meshserve.plan import get_gpu, get_model
from meshserve.plan import simulate as simulate_module
from meshserve.plan.goodput import Workload, operating_point, slo_capacity
from meshserve.plan.planner import make_perf_model
from meshserve.plan.simulate import _run, served_steps, simulate


class AffineSteps:
    """A step costs base + per_token x prompt tokens + per_decode x decodes + per_ctx x context."""

    def __init__(self, base=0.01, per_token=0.001, per_decode=0.002, per_ctx=0.0):
        self.base, self.per_token, self.per_decode, self.per_ctx = base, per_token, per_decode, per_ctx

    def mixed_step_time(self, prompt_tokens, pairs, sampled, decodes, decode_context):
        return (self.base + self.per_token * prompt_tokens + self.per_decode * decodes
                + self.per_ctx * decode_context)


def run(arrivals, prompt, output, *, max_seqs=100, budget=2048, cap=None, perf=None, token_overhead=0.0):
    seqs, _ = _run(served_steps(perf or AffineSteps(), token_overhead), Workload(prompt, output), np.array(arrivals),
                   max_seqs, budget, cap)
    return [(s.first_token - s.arrival, s.end - s.first_token) for s in seqs]


def test_a_prompt_arriving_during_another_waits_for_its_step_then_shares_one_with_its_decode():
    (a_ttft, a_rest), (b_ttft, b_rest) = run([0.0, 0.05], 100, 3)
    # A's prompt: 0.11 s. B joins A's first decode: 0.01 + 0.1 + 0.002 = 0.112, so its first token
    # is at 0.222; then both decode (0.014) and A ends; B decodes alone (0.012).
    assert a_ttft == pytest.approx(0.11)
    assert b_ttft == pytest.approx(0.222 - 0.05)
    assert a_rest == pytest.approx(0.112 + 0.014)
    assert b_rest == pytest.approx(0.014 + 0.012)


def test_every_token_a_step_emits_adds_the_serving_paths_time_to_the_step():
    (a_ttft, a_rest), (b_ttft, b_rest) = run([0.0, 0.05], 100, 3, token_overhead=0.001)
    # The steps of the test above, each longer by 1 ms per token it emits: A's prompt step emits
    # one (0.111); B's prompt ends in A's first decode step, two tokens (0.114); both decode (0.016);
    # B alone (0.013).
    assert a_ttft == pytest.approx(0.111)
    assert b_ttft == pytest.approx(0.111 + 0.114 - 0.05)
    assert a_rest == pytest.approx(0.114 + 0.016)
    assert b_rest == pytest.approx(0.016 + 0.013)


def test_the_chunk_cap_spreads_a_prompt_over_steps_with_the_running_decodes():
    _, (b_ttft, _) = run([0.0, 0.05], 100, 10, cap=40)
    # B's 100 tokens join A's decodes as 40 + 40 + 20: 0.052 + 0.052 + 0.032 after A's prompt ends.
    assert b_ttft == pytest.approx(0.11 + 0.052 + 0.052 + 0.032 - 0.05)
    _, (uncapped, _) = run([0.0, 0.05], 100, 10)
    assert uncapped < b_ttft


def test_a_backlog_beyond_one_step_ignores_the_chunk_cap():
    # A decodes when B, C, D (300 prompt tokens, more than the 150 a step takes) are waiting: a
    # full step takes B whole and 49 of C; then only D waits and the cap holds again.
    _, (b_ttft, _), (c_ttft, _), _ = run([0.0, 0.05, 0.05, 0.05], 100, 10, budget=150, cap=40)
    assert b_ttft == pytest.approx(0.11 + 0.01 + 0.149 + 0.002 - 0.05)
    # Then the cap: 40 of C's last 51, then its 11 and 29 of D, each step with A's and B's decodes.
    assert c_ttft == pytest.approx(b_ttft + 2 * (0.01 + 0.04 + 0.004))


def test_the_token_budget_chunks_the_second_of_two_prompts():
    (a_ttft, _), (b_ttft, _) = run([0.0, 0.0], 100, 4, budget=150)
    assert a_ttft == pytest.approx(0.01 + 0.15)                  # A whole and 50 of B
    assert b_ttft == pytest.approx(0.16 + 0.01 + 0.05 + 0.002)   # B's other 50 with A's decode


def test_a_full_cache_holds_the_next_prompt_until_a_sequence_ends():
    (_, a_rest), (b_ttft, _) = run([0.0, 0.0], 10, 5, max_seqs=1)
    assert b_ttft == pytest.approx(0.02 + a_rest + 0.02)


def test_decode_runs_taken_at_once_match_steps_taken_one_by_one(monkeypatch):
    """Between arrivals and finishes the simulator sums decode steps in closed form; with a
    context-dependent step time that must equal stepping one decode step at a time."""
    perf = AffineSteps(per_ctx=1e-5)
    arrivals = np.cumsum(np.random.default_rng(3).exponential(0.15, 30))
    summed = run(arrivals, 50, 40, perf=perf)
    monkeypatch.setattr(simulate_module, "_decode_run", lambda step, batch, context, max_steps, horizon:
                        (1, step(0, 0.0, batch, batch, context)))
    assert run(arrivals, 50, 40, perf=perf) == [pytest.approx(r, rel=1e-9) for r in summed]
    alone = run([0.0], 50, 40, perf=perf)[0]
    assert alone[1] == pytest.approx(sum(0.01 + 0.002 + 1e-5 * (51 + k) for k in range(39)))


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.floats(0, 3), min_size=1, max_size=12),
       prompt=st.integers(1, 300), output=st.integers(1, 30), budget=st.integers(16, 600),
       cap=st.one_of(st.none(), st.integers(1, 128)), max_seqs=st.integers(1, 8))
def test_every_request_finishes_in_order_of_events(arrivals, prompt, output, budget, cap, max_seqs):
    arrivals = sorted(arrivals)
    perf = AffineSteps(per_ctx=1e-6)
    seqs, running = _run(served_steps(perf), Workload(prompt, output), np.array(arrivals), max_seqs, budget, cap)
    fastest_prefill = perf.mixed_step_time(min(prompt, budget), 0, 1, 0, 0)
    for s in seqs:
        assert s.generated == output and s.prompt_left == 0
        assert s.first_token - s.arrival >= min(fastest_prefill, 0.01 + 0.001) - 1e-12
        assert s.end >= s.first_token
    # First come, first served: an earlier arrival never gets its first token later.
    firsts = [s.first_token for s in seqs]
    assert firsts == sorted(firsts)
    assert running > 0


def smollm2_on(gpu: str):
    return make_perf_model(get_model("SmolLM2-135M"), get_gpu(gpu), 1, 1, weight_dtype="bf16",
                           kv_dtype="bf16", gpus_per_node=8, compute_efficiency=0.7)


def test_at_light_load_the_simulation_is_one_prefill_and_single_decode_steps():
    perf = smollm2_on("L40S")
    work = Workload(256, 64)
    sim = simulate(perf, work, 1e-3, max_seqs=64, num_requests=6, runs=2)
    assert sim.ttft_p50_s == pytest.approx(perf.prefill_time(256), rel=1e-6)
    one = [perf.decode_step_time(1, 256 + k) for k in range(1, 64)]
    assert sim.tpot_p50_s == pytest.approx(sum(one) / 63, rel=1e-6)
    # The fluid model agrees with it there.
    op = operating_point(perf, 64, work, 1e-3)
    assert op.ttft_p50_s == pytest.approx(sim.ttft_p50_s, rel=0.05)
    assert op.itl_s == pytest.approx(sim.tpot_p50_s, rel=0.05)


def test_latency_grows_with_the_offered_load():
    perf = smollm2_on("L40S")
    work = Workload(512, 128)
    cap = slo_capacity(perf, 500, Workload(512, 128, slo_ttft_s=1.0, slo_itl_s=0.05))
    sims = [simulate(perf, work, f * cap, max_seqs=500, num_requests=60) for f in (0.2, 0.6, 1.0)]
    for low, high in zip(sims, sims[1:]):
        assert high.ttft_p50_s >= low.ttft_p50_s and high.tpot_p50_s > low.tpot_p50_s
        assert high.mean_running > low.mean_running
    assert all(s.ttft_p95_s >= s.ttft_p50_s and s.tpot_p95_s >= s.tpot_p50_s for s in sims)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_a_rate_must_be_positive_and_finite(rate):
    with pytest.raises(ValueError, match="rate"):
        simulate(AffineSteps(), Workload(10, 10), rate, max_seqs=4)


def test_plan_cli_shows_the_simulated_percentiles(capsys):
    argv = ["plan", "--model", "SmolLM2-135M", "--gpu", "L40S", "--prompt-len", "256", "--output-len", "64",
            "--max-model-len", "1024", "--request-rate", "20", "--simulate-requests", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Simulated at 20 req/s per replica (TP1 PP1 DP1; median of 16 runs of 40 Poisson requests" in out
    assert "2,048 tokens a step)" in out
    sim = run_json_sim(capsys, argv)
    assert sim["requests_per_run"] == 40 and 0 < sim["ttft_p50_ms"] <= sim["ttft_p95_ms"]
    assert main(argv[:-1] + ["1"]) == 2
    assert "--simulate-requests must be >= 2, got 1" in capsys.readouterr().err
    assert main(argv + ["--prefill-chunk-with-decodes", "-1"]) == 2
    assert "--prefill-chunk-with-decodes must be >= 0 (0: no cap), got -1" in capsys.readouterr().err
    # The scheduling knobs reach the simulation: a small chunk cap delays first tokens.
    capped = run_json_sim(capsys, argv + ["--prefill-chunk-with-decodes", "16"])
    assert capped["ttft_p50_ms"] > sim["ttft_p50_ms"]
    # The serving path outside the engine's steps adds to every first token, and to nothing else.
    served = run_json_sim(capsys, argv + ["--serving-overhead-ms", "7.5"])
    assert served["ttft_p50_ms"] == pytest.approx(sim["ttft_p50_ms"] + 7.5)
    assert served["ttft_p95_ms"] == pytest.approx(sim["ttft_p95_ms"] + 7.5)
    assert (served["tpot_p50_ms"], served["tpot_p95_ms"]) == (sim["tpot_p50_ms"], sim["tpot_p95_ms"])
    assert main(argv + ["--serving-overhead-ms", "7.5"]) == 0
    assert "7.5 ms serving path per TTFT" in capsys.readouterr().out
    assert main(argv + ["--serving-overhead-ms", "-1"]) == 2
    assert "--serving-overhead-ms must be >= 0, got -1" in capsys.readouterr().err
    # The serving path's time per streamed token lengthens every step, so TTFT and TPOT alike.
    streamed = run_json_sim(capsys, argv + ["--token-overhead-ms", "2"])
    assert streamed["tpot_p50_ms"] > sim["tpot_p50_ms"] + 2 - 1e-9
    assert streamed["ttft_p50_ms"] > sim["ttft_p50_ms"]
    assert main(argv + ["--token-overhead-ms", "2"]) == 0
    assert "2 ms serving path per streamed token" in capsys.readouterr().out
    assert main(argv + ["--token-overhead-ms", "-0.5"]) == 2
    assert "--token-overhead-ms must be >= 0, got -0.5" in capsys.readouterr().err


def run_json_sim(capsys, argv):
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return next(l for l in doc["layouts"] if l["name"] == doc["recommended"])["simulated"]
