"""The step-cost model (seconds ~ a + b*prompt_tokens + c*decodes + d*context, fitted on observed
steps) and the scheduler's use of it: with --decode-stall-ratio R, prompt work beside running decodes
is sized so that a step is predicted to take at most R decode-only steps."""
import argparse
import random

import pytest

from meshserve.config import EngineConfig
from meshserve.engine.block_manager import BlockManager
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.engine.step_cost import StepCostModel
from meshserve.sampling_params import SamplingParams

TRUE = (0.004, 2e-4, 1e-3, 1e-6)  # a (s per step), b (per prompt token), c (per decode), d (per context token)

RATIO = 1.5


def _seconds(coef, prompt, decodes, context) -> float:
    a, b, c, d = coef
    return a + b * prompt + c * decodes + d * context


def _trained(coef=TRUE, steps: int = 200, noise: float = 0.0, seed: int = 0) -> StepCostModel:
    """Observed steps like a server's: mostly decode-only, some with a prompt chunk."""
    rng = random.Random(seed)
    model = StepCostModel()
    for i in range(steps):
        decodes = rng.randint(1, 16)
        context = decodes * rng.randint(20, 2000)
        prompt = rng.randint(16, 512) if i % 3 == 0 else 0
        context += prompt
        seconds = _seconds(coef, prompt, decodes, context) * (1 + rng.gauss(0, noise))
        model.observe({"prompt_tokens": prompt, "prompts": int(prompt > 0), "decodes": decodes,
                       "context": context}, seconds)
    return model


def test_recovers_known_coefficients_without_noise():
    model = _trained()
    assert model.ready
    assert model.coefficients == pytest.approx(TRUE, rel=1e-6)
    assert model.predict(300, 4, 5000) == pytest.approx(_seconds(TRUE, 300, 4, 5000), rel=1e-9)


def test_recovers_known_coefficients_with_small_noise():
    model = _trained(steps=600, noise=0.01)
    for got, want in zip(model.coefficients, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert model.predict(256, 8, 8000) == pytest.approx(_seconds(TRUE, 256, 8, 8000), rel=0.02)


def test_occasional_slow_steps_do_not_move_the_fit():
    model = _trained(steps=300, noise=0.01)
    rng = random.Random(1)
    for _ in range(15):  # another process took the cores: a decode-only step 20x slower
        decodes = rng.randint(1, 16)
        context = decodes * 500
        model.observe({"prompt_tokens": 0, "decodes": decodes, "context": context},
                      20 * _seconds(TRUE, 0, decodes, context))
    for _ in range(16):  # refits lazily: the next fit includes the spikes
        model.observe({"prompt_tokens": 0, "decodes": 4, "context": 2000}, _seconds(TRUE, 0, 4, 2000))
    assert model.predict(0, 8, 8000) == pytest.approx(_seconds(TRUE, 0, 8, 8000), rel=0.05)
    assert model.predict(256, 8, 8256) == pytest.approx(_seconds(TRUE, 256, 8, 8256), rel=0.05)


def test_no_coefficient_is_negative():
    model = _trained(coef=(0.0, 2e-4, 1e-3, 0.0), noise=0.05)  # a and d truly zero: noise may pull below
    assert all(c >= 0 for c in model.coefficients)


def test_not_ready_before_enough_steps_of_each_kind():
    model = StepCostModel()
    for _ in range(50):  # decode-only steps alone leave the prompt cost unknown
        model.observe({"prompt_tokens": 0, "decodes": 4, "context": 400}, 0.01)
    assert not model.ready
    for i in range(7):
        model.observe({"prompt_tokens": 64 + i, "decodes": 4, "context": 470}, 0.02)
    assert not model.ready
    model.observe({"prompt_tokens": 0, "decodes": 0, "context": 0}, 0.5)  # an empty step is no step
    assert not model.ready
    model.observe({"prompt_tokens": 100, "decodes": 0, "context": 100}, 0.03)
    assert model.ready


def test_prompt_tokens_within_is_the_largest_count_that_fits():
    model = _trained()
    decodes, context = 6, 3000
    for budget in (0.02, 0.05, 0.137, 0.5):
        n = model.prompt_tokens_within(budget, decodes, context)
        assert model.predict(n, decodes, context + n) <= budget  # the context grows with the prompt
        assert model.predict(n + 1, decodes, context + n + 1) > budget
    decode_only = model.predict(0, decodes, context)
    assert model.prompt_tokens_within(decode_only, decodes, context) == 0
    assert model.prompt_tokens_within(decode_only / 2, decodes, context) == 0  # not even the decodes fit


# ---- the scheduler ------------------------------------------------------------------------------

BLOCK = 16
CAP = 256
BUDGET = 512


def _scheduler(model: StepCostModel | None, ratio: float | None, decodes: int = 2,
               prompt_len: int = 400) -> tuple[Scheduler, Sequence]:
    """`decodes` sequences decoding (20 prompt tokens and one sampled each), and a long prompt waiting."""
    bm = BlockManager(256, BLOCK)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=BUDGET, prefill_chunk_with_decodes=CAP,
                      step_cost=model, decode_stall_ratio=ratio)
    running = [Sequence(f"d{i}", 0, list(range(20 * i, 20 * i + 20)), SamplingParams(), 0.0) for i in range(decodes)]
    for seq in running:
        sched.add(seq)
    for item in sched.schedule().scheduled:
        item.seq.num_computed_tokens = item.start + item.num_tokens
        item.seq.token_ids.append(7)
    long = Sequence("long", 0, list(range(1000, 1000 + prompt_len)), SamplingParams(), 0.0)
    sched.add(long)
    return sched, long


def _prompt_chunk(sched: Scheduler, seq: Sequence) -> int:
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens = item.start + item.num_tokens
        if item.completes:
            item.seq.token_ids.append(7)
    return sum(i.num_tokens for i in out.scheduled if i.seq is seq)


def _expected_chunk(coef, ratio: float, decodes: int, context: int, prefilled: int = 0) -> int:
    b, d = coef[1], coef[3]
    decode_only = _seconds(coef, 0, decodes, context)
    spare = ratio * decode_only - _seconds(coef, 0, decodes, context + prefilled)
    return int(spare / (b + d) + 1e-9)


def test_prompt_chunks_beside_decodes_fit_the_stall_budget():
    coef = (0.01, 2e-5, 2e-3, 1e-6)  # 2 decodes: a 14 ms step; 1.2x leaves 2.8 ms, ~133 prompt tokens
    sched, long = _scheduler(_trained(coef), 1.2)
    context = 2 * 21  # each decode attends to its 20 prompt tokens and the token it computes
    first = _prompt_chunk(sched, long)
    assert first == _expected_chunk(coef, 1.2, 2, context)
    assert BLOCK < first < CAP  # the budget, not the cap or the floor, set it
    second = _prompt_chunk(sched, long)  # the next chunk also pays for attending to the first
    assert second == min(400 - first, _expected_chunk(coef, 1.2, 2, context + 2, prefilled=first))
    assert second <= first


def test_costly_prompt_tokens_still_progress_a_block_a_step():
    coef = (0.01, 5e-3, 2e-3, 1e-6)  # one prompt token costs more than the whole spare budget
    sched, long = _scheduler(_trained(coef), RATIO)
    assert [_prompt_chunk(sched, long) for _ in range(3)] == [BLOCK] * 3


def test_cheap_prompt_tokens_stay_within_the_fixed_cap():
    coef = (0.01, 1e-7, 2e-3, 0.0)
    sched, long = _scheduler(_trained(coef), RATIO)
    assert _prompt_chunk(sched, long) == CAP


@pytest.mark.parametrize("ratio", [None, 0])
def test_with_the_ratio_off_the_fixed_cap_applies(ratio):
    sched, long = _scheduler(_trained((0.01, 5e-3, 2e-3, 1e-6)), ratio)
    assert _prompt_chunk(sched, long) == CAP


def test_an_unready_model_leaves_the_fixed_cap():
    sched, long = _scheduler(StepCostModel(), RATIO)
    assert _prompt_chunk(sched, long) == CAP


def test_without_decodes_the_prompt_is_not_limited_by_the_budget():
    sched, long = _scheduler(_trained((0.01, 5e-3, 2e-3, 1e-6)), RATIO, decodes=0)
    assert _prompt_chunk(sched, long) == 400


def test_a_backlog_beyond_one_step_is_still_cleared_in_full_steps():
    sched, long = _scheduler(_trained((0.01, 5e-3, 2e-3, 1e-6)), RATIO, prompt_len=600)
    assert _prompt_chunk(sched, long) == BUDGET - 2  # the step's whole budget beside the two decodes


# ---- the flag -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0.5, -1, float("nan")])
def test_a_ratio_between_off_and_one_is_refused(bad):
    with pytest.raises(ValueError, match=r"decode_stall_ratio must be >= 1 \(or 0: off\)"):
        EngineConfig(model="x", decode_stall_ratio=bad)


def test_the_ratio_is_off_unless_asked_for_and_a_server_keeps_an_explicit_one():
    cpu = EngineConfig(model="x", device="cpu")
    assert cpu.decode_stall_ratio is None and cpu.serving_defaults().decode_stall_ratio is None
    assert EngineConfig(model="x", device="cpu", decode_stall_ratio=0).serving_defaults().decode_stall_ratio == 0
    assert EngineConfig(model="x", device="cpu", decode_stall_ratio=3).serving_defaults().decode_stall_ratio == 3


def test_the_flag_parses():
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--decode-stall-ratio", "2"])).decode_stall_ratio == 2.0
