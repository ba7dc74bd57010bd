"""Who may use a lease, and whose cached prefix a request may hit: a lease answers only its owner
(an unknown lease and another owner's alike), an owner holds a bounded number, a request that draws
on a lease that is released under it ends with a typed error (never silently), and prefix-cache
hits never cross a cache salt."""
from __future__ import annotations

import pytest
from tiny_model import write_tiny_config

from meshserve.config import EngineConfig
from meshserve.engine.block_manager import BlockManager, LeaseLimitError, ReservationError
from meshserve.engine.llm_engine import LLMEngine
from meshserve.engine.messages import ErrorCode, LeaseRef, ReserveRequest
from meshserve.engine.sequence import Sequence
from meshserve.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(1, 30))


def _seq(tokens, salt="", rid="r"):
    return Sequence(rid, 0, list(tokens), SamplingParams(), 0.0, salt)


def _run_to_cache(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate_slots(s, s.num_tokens)
    bm.commit_step()
    bm.free(s)  # its full blocks stay cached (free, reusable)


def test_prefix_hits_stay_within_their_cache_salt():
    bm = BlockManager(64, BS)
    _run_to_cache(bm, _seq(PROMPT, salt="tenant-a"))
    assert len(bm.find_cached_prefix(_seq(PROMPT, salt="tenant-a"))) == (len(PROMPT) - 1) // BS
    assert bm.find_cached_prefix(_seq(PROMPT, salt="tenant-b")) == []
    assert bm.find_cached_prefix(_seq(PROMPT)) == []  # unsalted is a scope of its own too
    # A reservation pins (and discounts) only its own salt's prefix.
    lease_b = bm.reserve("b", PROMPT, 4, 1, 1e9, cache_salt="tenant-b")
    lease_a = bm.reserve("a", PROMPT, 4, 1, 1e9, cache_salt="tenant-a")
    assert lease_b is not None and lease_a is not None
    assert lease_b.pinned == [] and len(lease_a.pinned) == (len(PROMPT) - 1) // BS
    assert lease_a.blocks < lease_b.blocks


def test_a_lease_is_used_only_by_its_owner_and_each_owner_holds_a_bounded_number():
    bm = BlockManager(64, BS)
    assert bm.reserve("mine", PROMPT, 4, 1, 1e9, owner="alice", max_owner_leases=2) is not None
    with pytest.raises(ReservationError, match="does not exist"):  # as if it did not exist
        bm.bind("mine", "r1", [_seq(PROMPT)], 4, owner="mallory")
    bm.bind("mine", "r1", [_seq(PROMPT)], 4, owner="alice")
    assert bm.reserve("second", PROMPT, 4, 1, 1e9, owner="alice", max_owner_leases=2) is not None
    with pytest.raises(LeaseLimitError, match="2 reservations"):
        bm.reserve("third", PROMPT, 4, 1, 1e9, owner="alice", max_owner_leases=2)
    assert bm.reserve("other", PROMPT, 4, 1, 1e9, owner="bob", max_owner_leases=2) is not None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_config(tmp_path_factory.mktemp("tiny"))
    eng = LLMEngine(EngineConfig(model=str(path), load_format="dummy", device="cpu", max_model_len=128,
                                 block_size=BS, kv_cache_memory_bytes=1 << 20))
    yield eng
    eng.shutdown()


def test_the_ledger_and_release_answer_only_the_owner(engine):
    lease = engine.reserve(ReserveRequest(PROMPT, 8, owner="alice"))
    assert lease is not None
    assert [x.lease_id for x in engine.leases("alice").leases] == [lease.lease_id]
    assert engine.leases("bob").leases == [] and engine.leases("").leases == []
    assert not engine.release_lease(LeaseRef(lease.lease_id, "bob"))
    assert engine.leases("alice").leases  # still there
    assert engine.release_lease(LeaseRef(lease.lease_id, "alice"))
    assert engine.leases("alice").leases == []


def test_releasing_a_lease_under_its_request_ends_the_request_with_why(engine):
    lease = engine.reserve(ReserveRequest(PROMPT, 40, owner="alice"))
    engine.add_request("leased", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), lease_id=lease.lease_id,
                       lease_owner="alice")
    engine.step()
    assert engine.has_unfinished_requests()
    assert engine.release_lease(LeaseRef(lease.lease_id, "alice"))
    assert engine.has_unfinished_requests()  # its last delta has not gone out yet
    deltas = engine.step()
    last = [d for d in deltas if d.request_id == "leased"]
    assert len(last) == 1 and last[0].finished
    assert last[0].error_code is ErrorCode.RESERVATION_RELEASED and "released" in last[0].error
    assert last[0].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.held_back_blocks == 0
