"""Paged KV blocks with reference counts and prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, its token ids, extra key),
where the extra key carries the model revision so cache entries never cross weights. A hit is
confirmed by comparing token ids, so a hash collision can never serve wrong K/V.

Free blocks sit in one LRU queue. A released block keeps its hash and stays reusable until it is
evicted from the head of the queue; a request's blocks are released tail-first, so its last
(least shareable) blocks are evicted first. A hit on a free block takes it out of the queue.
"""
from __future__ import annotations

from collections import OrderedDict

from meshserve.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set only while this block is the cache entry for it
        self.token_ids: tuple[int, ...] = ()


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

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks at the start of `seq`, leaving at least one token to
        compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[Block] = []
        num_full = (seq.num_tokens - 1) // bs
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block = self.cached.get(h)
            if block is None or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
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
        seq.num_computed_tokens = num_computed
        for _ in range(max(0, need)):
            seq.block_table.append(self._take_free_block().block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, (num_computed + num_new_tokens) // self.block_size)
        return True

    def _take_free_block(self) -> Block:
        _, block = self.free_queue.popitem(last=False)  # least recently used
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _register_full_blocks(self, seq: Sequence, num_full: int) -> None:
        # The tokens being computed this step are known now, and the model writes every new K/V
        # of a layer before any sequence reads the cache, so registering at scheduling time is safe.
        bs = self.block_size
        for i, h in enumerate(self._block_hashes(seq, num_full)[:num_full]):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.cached[h] = block

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = block
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_hash is not None and block.ref_count == 0:
                del self.cached[block.block_hash]
                block.block_hash = None
