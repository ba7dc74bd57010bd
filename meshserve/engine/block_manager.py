"""Paged KV blocks with reference counts and prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, its token ids, extra key),
where the extra key carries the model revision so cache entries never cross weights. A hit is
confirmed by comparing the block's own token ids and its parent: every cache entry remembers the
entry it extends (by a registration id that is never reused), so a hit is exact for the whole prefix
even if two different prefixes ever hashed alike.

A block enters the cache when the step that writes its K/V is scheduled, so that later sequences of
the same step share it (every layer writes all of a step's new K/V before any attention reads the
cache: n samples of one prompt compute it once). The step's registrations are provisional until
`commit_step`; if the step fails, `rollback_step` withdraws them, and only the failed step's own
sequences (failed with it) ever saw them: no later request can hit K/V that was never written.

Free blocks sit in one LRU queue. A released block keeps its hash and stays reusable until it is
evicted from the head of the queue; a request's blocks are released tail-first, so its last
(least shareable) blocks are evicted first. A hit on a free block takes it out of the queue.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from meshserve.engine.sequence import Sequence

_ROOT = 0  # the parent id of a sequence's first block


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "cache_id", "parent_cache_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set only while this block is the cache entry for it
        self.token_ids: tuple[int, ...] = ()
        self.cache_id = 0  # unique per registration (0: not registered)
        self.parent_cache_id = _ROOT


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_hash_key: str = ""):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory_bytes / gpu_memory_utilization")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = hash(("meshserve-kv", extra_hash_key))
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self._cache_ids = itertools.count(_ROOT + 1)
        self._provisional: list[Block] = []  # registered by the step being scheduled or run
        # Token counts, cumulative: prompt tokens of admitted sequences, and those found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    # ---- prefix cache ------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.root_hash
            hashes.append(hash((parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))))
        return hashes

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks at the start of `seq`, leaving at least one token to
        compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        num_full = (seq.num_tokens - 1) // self.block_size
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block = self.cached.get(h)
            parent = hits[-1].cache_id if hits else _ROOT
            if block is None or block.parent_cache_id != parent or block.token_ids != self._block_tokens(seq, i):
                break
            hits.append(block)
        return hits

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[Block] | None = None) -> bool:
        """Make `seq`'s block table cover its computed tokens plus `num_new_tokens`. All or nothing:
        returns False, changing nothing, when the free blocks do not suffice."""
        cached_prefix = cached_prefix or []
        num_computed = seq.num_computed_tokens + len(cached_prefix) * self.block_size
        have = len(seq.block_table) + len(cached_prefix)
        need = -(-(num_computed + num_new_tokens) // self.block_size) - have
        reusable = sum(1 for b in cached_prefix if b.ref_count == 0)  # those leave the free queue
        if need > len(self.free_queue) - reusable:
            return False
        for b in cached_prefix:
            if b.ref_count == 0:
                del self.free_queue[b.block_id]
            b.ref_count += 1
            seq.block_table.append(b.block_id)
            seq.chain_ids.append(b.cache_id)
        seq.num_computed_tokens = num_computed
        for _ in range(max(0, need)):
            seq.block_table.append(self._take_free_block().block_id)
        self._register(seq, (num_computed + num_new_tokens) // self.block_size)
        return True

    def _take_free_block(self) -> Block:
        _, block = self.free_queue.popitem(last=False)  # least recently used
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            block.cache_id = 0
        block.ref_count = 1
        return block

    def _register(self, seq: Sequence, num_full: int) -> None:
        """Make `seq`'s full blocks up to `num_full` findable. Work is proportional to the blocks
        filled since its last registration, not to its length."""
        chain = seq.chain_ids
        if not self.enable_prefix_caching or len(chain) >= num_full:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else _ROOT
            block, tokens = self.blocks[seq.block_table[i]], self._block_tokens(seq, i)
            entry = self.cached.get(hashes[i])
            if entry is not None and entry.parent_cache_id == parent and entry.token_ids == tokens:
                chain.append(entry.cache_id)  # the same content is cached already (another sequence's)
            elif entry is None and block.block_hash is None:
                block.block_hash, block.token_ids = hashes[i], tokens
                block.cache_id, block.parent_cache_id = next(self._cache_ids), parent
                self.cached[hashes[i]] = block
                self._provisional.append(block)
                chain.append(block.cache_id)
            else:  # a hash collision: this prefix stays private, and so do the blocks after it
                chain.append(next(self._cache_ids))

    def commit_step(self) -> None:
        """The step ran: the K/V of the blocks it registered are written."""
        self._provisional.clear()

    def rollback_step(self) -> None:
        """The step failed: withdraw what it registered (call before freeing its sequences)."""
        for block in self._provisional:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                block.cache_id = 0
        self._provisional.clear()

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = block
        seq.block_table = []
        seq.chain_ids = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_hash is not None and block.ref_count == 0:
                del self.cached[block.block_hash]
                block.block_hash = None
                block.cache_id = 0
