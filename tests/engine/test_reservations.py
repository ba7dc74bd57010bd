"""KV reservations in the block manager and scheduler: a grant never exceeds the blocks not held back
already, leased sequences are never preempted and never wait behind unleased ones, and every lease's
blocks come back when it ends."""
import random

import pytest

from meshserve.engine.block_manager import BlockManager, ReservationError
from meshserve.engine.scheduler import Scheduler
from meshserve.engine.sequence import Sequence
from meshserve.routing.block_hash import prompt_block_hashes, root_hash
from meshserve.sampling_params import SamplingParams

BS = 4


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(), 0.0)


def test_grant_is_refused_when_unheld_blocks_do_not_cover_it():
    bm = BlockManager(10, BS)
    a = bm.reserve("a", list(range(10)), 10, 1, expires_at=1e9)  # 20 tokens = 5 blocks
    assert a is not None and a.blocks == 5 and bm.held_back == 5
    assert bm.reserve("b", list(range(100, 121)), 3, 1, expires_at=1e9) is None  # 6 blocks > 5 left
    assert bm.held_back == 5 and set(bm.leases) == {"a"}  # a refusal changes nothing
    assert bm.reserve("c", list(range(100, 110)), 10, 1, expires_at=1e9) is not None
    assert bm.reserved_blocks == 10 == bm.peak_reserved


def test_leases_sharing_a_running_prefix_count_its_blocks_once():
    """Requests with the prompt of one that is running pin its cached blocks: the ledger counts each
    block once, and grants stop exactly when the blocks are all promised."""
    bm = BlockManager(8, BS)
    prompt = list(range(9))  # 2 full blocks and one token; with 3 new tokens, 3 blocks
    bm.reserve("a", prompt, 3, 1, expires_at=1e9)
    first = seq(prompt)
    bm.bind("a", "req-a", [first], 3)
    assert bm.allocate_slots(first, first.num_tokens)
    bm.commit_step()
    followers = [bm.reserve(f"f{i}", prompt, 3, 1, expires_at=1e9) for i in range(6)]
    assert all(f is not None and f.blocks == 1 and len(f.pinned) == 2 for f in followers[:5])
    assert followers[5] is None  # 3 in use + 5 held back: all 8 promised
    assert bm.reserved_blocks == 8 == bm.peak_reserved == bm.num_blocks
    for i in range(5):
        bm.release(f"f{i}")
    assert bm.reserved_blocks == 3 and bm.held_back == 0
    bm.free(first)
    bm.release("a")
    assert bm.reserved_blocks == 0 and bm.num_free_blocks == 8


def test_unleased_work_cannot_take_held_back_blocks():
    bm = BlockManager(10, BS)
    bm.reserve("a", list(range(10)), 14, 1, expires_at=1e9)  # 6 blocks held back
    big = seq(range(100, 120))  # 5 blocks: only 4 are not held back
    assert not bm.allocate_slots(big, big.num_tokens)
    small = seq(range(100, 116))
    assert bm.allocate_slots(small, small.num_tokens)
    assert bm.num_free_blocks == 6 == bm.held_back


def test_a_leased_sequence_draws_on_its_lease_and_the_lease_returns_everything():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    bm.reserve("a", tokens, 6, 1, expires_at=1e9)  # 16 tokens = 4 blocks
    s = seq(tokens)
    bm.bind("a", "req-a", [s], 6)
    assert bm.allocate_slots(s, s.num_tokens)  # 3 blocks for the prompt
    assert bm.held_back == 1 and bm.leases["a"].taken == 3
    bm.free(s)
    bm.release("a")
    assert bm.held_back == 0 and bm.num_free_blocks == 8 and not bm.leases


def test_reservation_discounts_and_pins_the_cached_prefix():
    bm = BlockManager(8, BS)
    warm = seq(list(range(12)) + [99])
    assert bm.allocate_slots(warm, warm.num_tokens)
    bm.commit_step()
    bm.free(warm)  # 3 full blocks stay cached in the free queue
    lease = bm.reserve("a", list(range(12)) + [50, 51], 2, 1, expires_at=1e9)
    assert len(lease.pinned) == 3 and lease.blocks == 1  # 16 tokens = 4 blocks, 3 cached
    # Pinned blocks are out of the free queue: a flood of other work cannot evict them.
    flood = seq(range(200, 216))
    assert bm.allocate_slots(flood, flood.num_tokens) and len(bm.free_queue) == 1 == bm.held_back
    s = seq(list(range(12)) + [50, 51])
    bm.bind("a", "req", [s], 2)
    prefix = bm.find_cached_prefix(s)
    assert [b.block_id for b in prefix] == [b.block_id for b in lease.pinned]
    assert bm.allocate_slots(s, s.num_tokens - 12, prefix)
    bm.free(s)
    bm.release("a")
    bm.free(flood)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_bind_refuses_unknown_used_and_too_small_leases():
    bm = BlockManager(16, BS)
    with pytest.raises(ReservationError, match="does not exist"):
        bm.bind("nope", "r", [seq([1, 2])], 4)
    bm.reserve("a", [1, 2], 2, 1, expires_at=1e9)  # 1 block
    with pytest.raises(ReservationError, match="needs 3"):
        bm.bind("a", "r", [seq([1, 2])], 10)
    bm.bind("a", "r", [seq([1, 2])], 2)
    with pytest.raises(ReservationError, match="already used"):
        bm.bind("a", "r2", [seq([1, 2])], 2)


def test_expired_leases_are_listed_for_reconciliation():
    bm = BlockManager(16, BS)
    bm.reserve("old", [1], 3, 1, expires_at=5.0)
    bm.reserve("new", [2], 3, 1, expires_at=50.0)
    assert [lease.lease_id for lease in bm.expired_leases(now=10.0)] == ["old"]


def test_gateway_hashes_are_the_block_managers_hashes():
    bm = BlockManager(16, BS, extra_hash_key="rev-1")
    tokens = list(range(23))
    s = seq(tokens)
    assert bm.allocate_slots(s, s.num_tokens)
    assert prompt_block_hashes(tokens, BS, root_hash("rev-1")) == s.block_hashes[:5]
    assert prompt_block_hashes(tokens, BS, root_hash("rev-2")) != s.block_hashes[:5]


def _drive(sched: Scheduler, steps: int = 5000):
    """Run the scheduler as the engine does (token 7 sampled; each sequence stops at its max_tokens);
    yields each step's output."""
    for _ in range(steps):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        yield out
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_tokens
            if item.completes:
                item.seq.token_ids.append(7)
                if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                    sched.finish(item.seq, "length")
                    if item.seq.lease is not None:
                        sched.bm.release(item.seq.lease.lease_id)


def test_leased_sequences_are_never_preempted_and_pass_a_blocked_queue():
    rng = random.Random(1)
    bm = BlockManager(40, BS)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=64)
    leased, free_riders = [], []
    for i in range(24):
        tokens = [rng.randrange(1000) for _ in range(rng.randint(4, 30))]
        s = Sequence(str(i), 0, tokens, SamplingParams(max_tokens=rng.randint(4, 24)), 0.0)
        if i % 3 == 0 and bm.reserve(f"L{i}", tokens, s.params.max_tokens, 1, expires_at=1e9) is not None:
            bm.bind(f"L{i}", s.request_id, [s], s.params.max_tokens)
            leased.append(s)
        else:
            free_riders.append(s)
        sched.add(s)
    assert leased, "some leases must have been granted"
    for out in _drive(sched):
        assert not any(s.lease is not None for s in out.preempted)
        assert bm.num_free_blocks >= bm.held_back  # the promise can always be kept
    assert all(s.is_finished and s.num_preemptions == 0 for s in leased)
    assert all(s.is_finished for s in free_riders)
    assert sched.num_preemptions > 0  # the unleased ones were squeezed, not the leased ones
    assert bm.num_free_blocks == 40 and bm.held_back == 0 and not bm.leases
