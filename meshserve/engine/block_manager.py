"""Paged KV blocks with reference counts and prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, its token ids), whose root
carries the model revision, so cache entries never cross weights, and the request's cache salt, so
entries of one salt (one tenant) are never a hit for another. A hit is
confirmed by comparing the block's own token ids and its parent: every cache entry remembers the
entry it extends (by a registration id that is never reused), so a hit is exact for the whole prefix
even if two different prefixes ever hashed alike.

A block enters the cache when the step that writes its K/V is scheduled, so that later sequences of
the same step share it (every layer writes all of a step's new K/V before any attention reads the
cache: n samples of one prompt compute it once). The step's registrations are provisional until
`commit_step`; if the step fails, `rollback_step` withdraws them, and only the failed step's own
sequences (failed with it) ever saw them: no later request can hit K/V that was never written.
With overlap scheduling a second step is launched before the first commits: steps commit in launch
order, and a failed step takes the steps launched after it down, so `rollback_step` withdraws all.

Free blocks sit in one LRU queue. A released block keeps its hash and stays reusable until it is
evicted from the head of the queue; a request's blocks are released tail-first, so its last
(least shareable) blocks are evicted first. A hit on a free block takes it out of the queue.

Reservations (leases) promise blocks to a request before it arrives. A lease holds back `blocks`
free blocks and pins the cached prefix it was sized against (so that prefix cannot be evicted
before the request uses it). The invariant is `free blocks >= held back`: work without a lease may
only take blocks beyond what leases hold back, and a leased sequence draws on its own lease, so a
granted lease can always be honoured without preempting anyone. One block manager serves every
rank of a replica (the KV budget is the smallest rank's), so a grant is atomic for all ranks.
"""
from __future__ import annotations

import functools
import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence as Tokens

from meshserve.engine.sequence import Sequence
from meshserve.routing.block_hash import extend_chain, root_hash

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


class ReservationError(ValueError):
    """A request names a lease that cannot cover it (ended, expired, in use, too small, not its own)."""


class LeaseLimitError(ValueError):
    """The owner holds as many leases as it may."""


class Lease:
    """Blocks promised to one request (or one attempt of it) until it ends or the lease expires."""
    __slots__ = ("lease_id", "request_id", "attempt_id", "blocks", "expires_at", "pinned", "taken", "bound_to",
                 "seqs", "owner", "cache_salt", "importing", "ttl_s")

    def __init__(self, lease_id: str, request_id: str, attempt_id: str, blocks: int, expires_at: float,
                 pinned: list[Block], owner: str = "", cache_salt: str = "") -> None:
        self.lease_id = lease_id
        self.owner = owner  # only requests and calls of the same owner may use, see or end it
        self.cache_salt = cache_salt  # its pinned prefix is this salt's
        self.request_id = request_id  # the client's request (for the ledger and traces)
        self.attempt_id = attempt_id
        self.blocks = blocks  # blocks promised beyond the pinned prefix
        self.expires_at = expires_at  # monotonic; an unbound lease ends then
        self.ttl_s = 0.0  # how long it lives unused (a hand-off renews it by as much: kv_transfer)
        self.pinned = pinned  # the cached prefix the size was computed against
        self.taken = 0  # blocks its request took out of the free queue so far
        self.bound_to: str | None = None  # the engine request drawing on it
        self.seqs: list[Sequence] = []  # its request's sequences, once bound
        self.importing: list[Block] = []  # destinations of a KV hand-off not committed yet (kv_transfer)

    @property
    def remaining(self) -> int:
        return max(0, self.blocks - self.taken)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 extra_hash_key: str = ""):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise kv_cache_memory_bytes / gpu_memory_utilization")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._extra_hash_key = extra_hash_key
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self._cache_ids = itertools.count(_ROOT + 1)
        self._provisional: list[Block] = []  # registered by the step being scheduled
        self._launched: deque[list[Block]] = deque()  # by the steps in flight, oldest first
        # Token counts, cumulative: prompt tokens of admitted sequences, and those found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.leases: dict[str, Lease] = {}
        self.held_back = 0  # sum of the leases' remaining blocks: never more than the free blocks
        self.peak_reserved = 0  # most blocks ever promised at once (see reserved_blocks)

    # ---- accounting --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    # ---- prefix cache ------------------------------------------------------------------
    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one block manager per engine, salts are few)
    def roots(self, cache_salt: str) -> tuple[int, int]:
        """(the hash a salt's first block chains from, the parent id its cache entry records). The
        unsalted parent id is _ROOT; a salted chain's is its root hash, so that even a hash collision
        cannot make a block of one salt a hit for another."""
        root = root_hash(self._extra_hash_key + ("\0salt\0" + cache_salt if cache_salt else ""))
        return root, (root if cache_salt else _ROOT)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        return extend_chain(seq.block_hashes, seq.token_ids, self.block_size, self.roots(seq.cache_salt)[0],
                            num_full_blocks)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks at the start of `seq`, leaving at least one token to
        compute (its logits are needed to sample)."""
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = self._cached_run(seq.token_ids, self._block_hashes(seq, num_full)[:num_full],
                                self.roots(seq.cache_salt)[1]) if self.enable_prefix_caching else []
        lease = seq.lease  # its pins hold K/V handed over for this prompt even where nothing is cached
        if lease is not None and len(lease.pinned) > len(hits) and self._pins_fit(lease, seq.token_ids, seq.cache_salt):
            return list(lease.pinned)
        return hits

    def _pins_fit(self, lease: Lease, tokens: Tokens[int], cache_salt: str) -> bool:
        """The lease's pinned blocks are the first blocks of `tokens` (leaving one token to compute)."""
        bs = self.block_size
        return lease.cache_salt == cache_salt and len(lease.pinned) * bs < len(tokens) \
            and all(b.token_ids == tuple(tokens[i * bs:(i + 1) * bs]) for i, b in enumerate(lease.pinned))

    def _cached_run(self, token_ids: Tokens[int], hashes: list[int], root_parent: int) -> list[Block]:
        hits: list[Block] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            parent = hits[-1].cache_id if hits else root_parent
            if block is None or block.parent_cache_id != parent \
                    or block.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
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
        lease = seq.lease
        # Blocks held back for leases are out of reach, except the ones held for this sequence.
        headroom = len(self.free_queue) - self.held_back + (lease.remaining if lease is not None else 0)
        if max(0, need) + reusable > headroom:
            return False
        if lease is not None:
            drawn = max(0, need) + reusable
            self.held_back -= min(drawn, lease.remaining)
            lease.taken += drawn
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
        num_full = min(num_full, len(seq.token_ids) // self.block_size)  # not a pending token's block
        if not self.enable_prefix_caching or len(chain) >= num_full:
            return
        hashes = self._block_hashes(seq, num_full)
        root_parent = self.roots(seq.cache_salt)[1]
        for i in range(len(chain), num_full):
            parent = chain[-1] if chain else root_parent
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

    def launch_step(self) -> None:
        self._launched.append(self._provisional)
        self._provisional = []

    def commit_step(self) -> None:
        """The oldest step in flight (else the one scheduled) ran: its registered blocks are written."""
        (self._launched.popleft() if self._launched else self._provisional).clear()

    def rollback_step(self) -> None:
        """The oldest step in flight failed: withdraw what it and every step scheduled after it
        registered, as those never run (call before freeing their sequences)."""
        for block in [b for step in self._launched for b in step] + self._provisional:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                block.cache_id = 0
        self._launched.clear()
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

    # ---- reservations --------------------------------------------------------------------
    def reserve(self, lease_id: str, token_ids: Tokens[int], max_new_tokens: int, num_seqs: int,
                expires_at: float, request_id: str = "", attempt_id: str = "", owner: str = "",
                cache_salt: str = "", max_owner_leases: int | None = None) -> Lease | None:
        """Promise the blocks a request of `token_ids` plus `max_new_tokens` (times `num_seqs`
        samples) needs beyond what is cached for its prefix (under its salt) now; None (changing
        nothing) when the blocks not held back for other leases do not cover it. LeaseLimitError
        when `owner` holds `max_owner_leases` already."""
        if max_owner_leases is not None and sum(lease.owner == owner for lease in self.leases.values()) \
                >= max_owner_leases:
            raise LeaseLimitError(f"this key holds {max_owner_leases} reservations, as many as it may at once")
        prefix = self._prefix_for(token_ids, cache_salt)
        per_seq = -(-(len(token_ids) + max_new_tokens) // self.block_size) - len(prefix)
        blocks = num_seqs * per_seq
        pins_from_free = sum(1 for b in prefix if b.ref_count == 0)
        if blocks + pins_from_free > len(self.free_queue) - self.held_back:
            return None
        for b in prefix:
            if b.ref_count == 0:
                del self.free_queue[b.block_id]
            b.ref_count += 1
        lease = Lease(lease_id, request_id, attempt_id, blocks, expires_at, prefix, owner, cache_salt)
        self.leases[lease_id] = lease
        self.held_back += blocks
        self.peak_reserved = max(self.peak_reserved, self.reserved_blocks)
        return lease

    def _prefix_for(self, token_ids: Tokens[int], cache_salt: str) -> list[Block]:
        if not self.enable_prefix_caching:
            return []
        num_full = (len(token_ids) - 1) // self.block_size  # as find_cached_prefix leaves one to compute
        root, root_parent = self.roots(cache_salt)
        return self._cached_run(token_ids, extend_chain([], token_ids, self.block_size, root, num_full), root_parent)

    @property
    def reserved_blocks(self) -> int:
        """Distinct blocks promised to live leases: those their requests hold now and the prefix
        blocks they pin (each counted once, however many sequences share it), plus those held back
        for them. Never more than num_blocks: only free blocks are held back."""
        held = {b.block_id for lease in self.leases.values() for b in lease.pinned + lease.importing}
        held.update(i for lease in self.leases.values() for s in lease.seqs for i in s.block_table)
        return len(held) + self.held_back

    def bind(self, lease_id: str, request_id: str, seqs: list[Sequence], max_new_tokens: int,
             owner: str = "") -> Lease:
        """Let `seqs` (one request) draw on the lease. ReservationError when the lease is unknown
        (ended, expired, or another owner's), already used, or too small for the request."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:
            raise ReservationError(f"reservation {lease_id!r} does not exist (it ended or expired)")
        if lease.bound_to is not None:
            raise ReservationError(f"reservation {lease_id!r} is already used by another request")
        self.cancel_import(lease_id)  # a hand-off not committed by now never will be: recompute instead
        tokens = seqs[0].token_ids
        bs = self.block_size
        pinned_match = self._pins_fit(lease, tokens, seqs[0].cache_salt)
        need = len(seqs) * (-(-(len(tokens) + max_new_tokens) // bs) - (len(lease.pinned) if pinned_match else 0))
        if need > lease.blocks:
            raise ReservationError(f"reservation {lease_id!r} holds {lease.blocks} blocks; this request needs {need}")
        lease.bound_to = request_id
        lease.seqs = seqs
        for s in seqs:
            s.lease = lease
        return lease

    def release(self, lease_id: str) -> Lease | None:
        """End a lease: what it still held back and its pins return to the pool (a no-op if gone)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return None
        self.held_back -= lease.remaining
        lease.taken = lease.blocks
        self.unhold([b.block_id for b in lease.pinned + lease.importing])
        lease.pinned, lease.importing = [], []
        lease.seqs = []
        return lease

    # ---- the destination blocks of a KV hand-off (kv_transfer) -------------------------------
    def take_for_import(self, lease_id: str, owner: str, num_blocks: int) -> list[Block] | None:
        """`num_blocks` blocks out of what an unbound lease promises, to receive a prompt's K/V after
        its pinned prefix; None when the lease is not the owner's, is in use or promises fewer."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner or lease.bound_to is not None or lease.importing \
                or lease.remaining < num_blocks:
            return None
        lease.blocks -= num_blocks
        self.held_back -= num_blocks
        lease.importing = [self._take_free_block() for _ in range(num_blocks)]
        return lease.importing

    def commit_import(self, lease: Lease, token_ids: Tokens[int]) -> None:
        """The hand-off's K/V are written: its blocks join the lease's pinned prefix (the request that
        draws on the lease starts after them) and the prefix cache."""
        bs = self.block_size
        first = len(lease.pinned)
        num_full = first + len(lease.importing)
        root, root_parent = self.roots(lease.cache_salt)
        hashes = extend_chain([], token_ids, bs, root, num_full)
        for i, block in enumerate(lease.importing, start=first):
            parent = lease.pinned[-1].cache_id if lease.pinned else root_parent
            block.token_ids, block.parent_cache_id = tuple(token_ids[i * bs:(i + 1) * bs]), parent
            if self.enable_prefix_caching and hashes[i] not in self.cached:
                block.block_hash, block.cache_id = hashes[i], next(self._cache_ids)
                self.cached[hashes[i]] = block
            else:  # another entry holds this content: this copy stays private to the lease
                block.cache_id = next(self._cache_ids)
            lease.pinned.append(block)
        lease.importing = []

    def cancel_import(self, lease_id: str) -> None:
        """The hand-off failed: its blocks go back to the pool, promised to the lease again."""
        lease = self.leases.get(lease_id)
        if lease is None or not lease.importing:
            return
        n = len(lease.importing)
        self.unhold([b.block_id for b in lease.importing])
        lease.importing = []
        lease.blocks += n
        self.held_back += n

    def hold(self, block_ids: list[int]) -> None:
        """Keep blocks out of the pool beyond their sequence's end (a hand-off still reading them)."""
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_count == 0:
                del self.free_queue[i]
            block.ref_count += 1

    def unhold(self, block_ids: list[int]) -> None:
        for i in block_ids:
            block = self.blocks[i]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[i] = block

    def expired_leases(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.expires_at <= now]

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.block_hash is not None and block.ref_count == 0:
                del self.cached[block.block_hash]
                block.block_hash = None
                block.cache_id = 0
