"""Invariants of the paged KV block manager: reference counts, prefix-cache hash chain, LRU eviction."""
import pytest

from meshserve.engine.block_manager import BlockManager
from meshserve.engine.sequence import Sequence
from meshserve.sampling_params import SamplingParams

BS = 4


def seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams(), 0.0)


def admit(bm, s):
    prefix = bm.find_cached_prefix(s)
    assert bm.allocate_slots(s, s.num_tokens - len(prefix) * BS, prefix)
    return len(prefix) * BS


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, BS)
    s = seq(range(20))  # needs 5 blocks
    assert not bm.allocate_slots(s, 20)
    assert bm.num_free_blocks == 4 and s.block_table == [] and s.num_computed_tokens == 0


def test_shared_prefix_is_found_and_reference_counted():
    bm = BlockManager(16, BS)
    a, b = seq(range(10)), seq(list(range(8)) + [99, 98, 97])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8  # two full blocks shared
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_hit_leaves_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(range(8))
    admit(bm, a)
    bm.free(a)
    b = seq(range(8))  # identical, block aligned: the last block must be recomputed for logits
    assert admit(bm, b) == 4


def test_hash_chain_depends_on_the_whole_prefix():
    bm = BlockManager(16, BS)
    admit(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: no hit at all.
    assert bm.find_cached_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_hash_collision_is_caught_by_token_check():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # as if another token run had produced the same hash
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5])) == []


def test_model_revision_scopes_the_cache():
    a_bm, b_bm = BlockManager(8, BS, extra_hash_key="rev-a"), BlockManager(8, BS, extra_hash_key="rev-b")
    s1, s2 = seq(range(9)), seq(range(9))
    admit(a_bm, s1)
    b_bm._block_hashes(s2, 2)
    assert s1.block_hashes[:2] != s2.block_hashes[:2]


def test_freed_blocks_stay_cached_until_evicted_lru_tail_first():
    bm = BlockManager(4, BS)
    a = seq(range(12))  # 3 full blocks
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 3
    probe = lambda: len(bm.find_cached_prefix(seq(list(range(12)) + [77])))  # noqa: E731
    assert probe() == 3
    # Two fresh blocks: the never-used block goes first, then a's *last* block, keeping its prefix.
    c = seq([50, 51, 52, 53, 54, 55, 56])
    assert admit(bm, c) == 0
    assert probe() == 2


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(9))
    admit(bm, a)
    assert admit(bm, seq(range(9))) == 0 and not bm.cached


def test_no_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        BlockManager(0, BS)


def test_a_hit_checks_the_parent_chain_not_only_the_blocks_own_tokens():
    bm = BlockManager(16, BS)
    a = seq(range(9))
    admit(bm, a)
    bm.commit_step()
    # Forge a collision: the second block's entry claims to extend a different first block.
    second = bm.blocks[a.block_table[1]]
    second.parent_cache_id = 12345
    assert len(bm.find_cached_prefix(seq(list(range(8)) + [50]))) == 1


def test_a_failed_step_leaves_nothing_in_the_cache():
    bm = BlockManager(16, BS)
    a = seq(range(9))
    admit(bm, a)
    assert len(bm.find_cached_prefix(seq(list(range(8)) + [50]))) == 2  # visible within its own step
    bm.rollback_step()
    bm.free(a)
    assert not bm.cached and bm.find_cached_prefix(seq(list(range(8)) + [50])) == []
    assert bm.num_free_blocks == 16
    b = seq(range(9))  # a committed step keeps its entries
    admit(bm, b)
    bm.commit_step()
    bm.rollback_step()
    assert len(bm.find_cached_prefix(seq(list(range(8)) + [50]))) == 2


def test_registration_work_does_not_grow_with_length():
    """Each step hashes and registers only the blocks it filled, not the whole sequence again."""
    bm = BlockManager(64, BS)
    s = seq(range(5))
    admit(bm, s)
    calls = []
    real = bm._block_tokens
    bm._block_tokens = lambda q, i: calls.append(i) or real(q, i)
    for t in range(100, 140):  # decode 40 tokens
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(t)
        assert bm.allocate_slots(s, 1)
    assert sorted(calls) == list(range(1, 11))  # blocks 1..10 registered once each
