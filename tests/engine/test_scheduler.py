"""Scheduler invariants under a simulated model: token budget, max_num_seqs, preemption without loss,
blocks never leaked, shared prefixes computed once."""
import random

from meshserve.engine.block_manager import BlockManager
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.sampling_params import SamplingParams

BS = 4


def run(sched: Scheduler, seqs, max_tokens, steps=10_000):
    """Drive the scheduler like the engine does, 'sampling' token 7. Returns per-step outputs."""
    for s in seqs:
        sched.add(s)
    history = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        history.append(out)
        assert out.scheduled, "work was left but nothing could be scheduled"
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_tokens
            if item.completes:
                item.seq.token_ids.append(7)
                if item.seq.num_output_tokens >= max_tokens:
                    sched.finish(item.seq, "length")
    return history


def test_budget_seq_limit_and_no_leak_under_pressure():
    rng = random.Random(0)
    bm = BlockManager(40, BS)
    sched = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=24)
    seqs = [Sequence(str(i), 0, [rng.randrange(100) for _ in range(rng.randint(1, 60))], SamplingParams(), 0.0)
            for i in range(30)]
    history = run(sched, seqs, max_tokens=20)
    assert all(h.num_batched_tokens <= 24 for h in history)
    assert all(len(h.scheduled) <= 5 for h in history)
    assert sched.num_preemptions > 0  # 40 blocks cannot hold 5 sequences of up to 80 tokens
    assert all(s.is_finished and s.num_output_tokens == 20 for s in seqs)  # nothing lost
    assert bm.num_free_blocks == 40


def test_chunked_prefill_does_not_starve_running_decodes():
    bm = BlockManager(200, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short = Sequence("a", 0, [1, 2, 3], SamplingParams(), 0.0)
    sched.add(short)
    out = sched.schedule()
    short.num_computed_tokens = 3
    short.token_ids.append(7)
    long = Sequence("b", 0, list(range(100)), SamplingParams(), 0.0)
    sched.add(long)
    for _ in range(5):
        out = sched.schedule()
        by_id = {i.seq.request_id: i for i in out.scheduled}
        assert by_id["a"].num_tokens == 1  # the decode runs every step
        assert by_id["b"].num_tokens == 15  # the prompt gets the rest of the budget
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_tokens
            if item.completes:
                item.seq.token_ids.append(7)


def test_without_chunked_prefill_a_prompt_waits_for_a_full_budget():
    bm = BlockManager(200, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=False)
    sched.add(Sequence("a", 0, list(range(40)), SamplingParams(), 0.0))
    sched.add(Sequence("b", 0, list(range(100, 140)), SamplingParams(), 0.0))
    out = sched.schedule()
    assert [i.num_tokens for i in out.scheduled] == [40]


def test_shared_prefix_is_computed_once():
    bm = BlockManager(100, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=1000)
    prefix = list(range(32))
    seqs = [Sequence(str(i), 0, prefix + [100 + i, 200 + i], SamplingParams(), 0.0) for i in range(4)]
    history = run(sched, seqs, max_tokens=3)
    prefill_tokens = sum(h.num_batched_tokens for h in history) - 4 * 2  # minus 2 decode steps each
    assert prefill_tokens == 32 + 4 * 2  # the 32-token prefix once, then each unique tail
    assert bm.prefix_hits == 3 * 32
    assert bm.num_free_blocks == 100


def test_preempted_sequence_resumes_with_its_tokens():
    bm = BlockManager(6, BS)  # 24 tokens in all
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", 0, list(range(8)), SamplingParams(), 0.0)
    b = Sequence("b", 0, list(range(50, 58)), SamplingParams(), 0.0)
    run(sched, [a, b], max_tokens=10)
    assert a.output_token_ids == [7] * 10 and b.output_token_ids == [7] * 10
    assert sched.num_preemptions > 0 and bm.num_free_blocks == 6


def test_prefill_chunks_are_capped_while_sequences_decode():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, prefill_chunk_with_decodes=8)
    first = Sequence("a", 0, list(range(20)), SamplingParams(), 0.0)
    sched.add(first)
    out = sched.schedule()  # nothing decodes yet: the whole prompt at once
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(0, 20)]
    first.num_computed_tokens = 20
    first.token_ids.append(7)  # it now decodes
    long = Sequence("b", 0, list(range(100, 130)), SamplingParams(), 0.0)
    sched.add(long)
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        assert (out.scheduled[0].seq, out.scheduled[0].num_tokens) == (first, 1)  # never stalled
        chunks += [s.num_tokens for s in out.scheduled if s.seq is long]
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_tokens
        first.token_ids.append(7)
    assert chunks == [8, 8, 8, 6]  # the 30-token prompt in chunks of at most 8


def test_a_backlog_beyond_one_step_is_admitted_in_full_steps_despite_the_cap():
    bm = BlockManager(256, 4)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=64, prefill_chunk_with_decodes=8)
    first = Sequence("a", 0, list(range(20)), SamplingParams(), 0.0)
    sched.add(first)
    sched.schedule()
    first.num_computed_tokens = 20
    first.token_ids.append(7)  # it now decodes
    for i in range(4):  # 4 x 20 = 80 prompt tokens wait: more than the 64 a step takes
        sched.add(Sequence(f"w{i}", 0, list(range(100 + 20 * i, 120 + 20 * i)), SamplingParams(), 0.0))

    def prompt_tokens() -> int:
        out = sched.schedule()
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_tokens
        first.token_ids.append(7)
        return sum(s.num_tokens for s in out.scheduled if s.seq is not first)

    assert prompt_tokens() == 63          # the backlog: a full step (64, one of it the decode)
    assert prompt_tokens() == 8           # 17 tokens left: the cap again
