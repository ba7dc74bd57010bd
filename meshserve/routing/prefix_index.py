"""A router's memory of which replica holds which prompt prefix: an LRU index of cache blocks.

It records the full blocks of every prompt it routes (hashed as the engine hashes them, see
block_hash.py) under the replica it sent them to, and answers "how many leading blocks of this
prompt did I send to each replica". It is approximate in one direction only: a replica may have
evicted what the index remembers (the credit for a match is bounded for that reason), but the index
never claims a prefix it did not send. Entries are keyed by a cache scope (revision, tokenizer,
template, tenant), so a hit never crosses scopes, and the index holds at most `max_blocks` entries.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    def __init__(self, max_blocks: int = 200_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"the prefix index needs room for at least 1 block, got {max_blocks}")
        self.max_blocks = max_blocks
        self._entries: OrderedDict[tuple[str, int], set[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, scope: str, hashes: Sequence[int], replica: int) -> None:
        """`replica` was sent a prompt whose full blocks hash to `hashes`."""
        for h in hashes:
            key = (scope, h)
            holders = self._entries.get(key)
            if holders is None:
                self._entries[key] = {replica}
            else:
                holders.add(replica)
                self._entries.move_to_end(key)
        while len(self._entries) > self.max_blocks:
            self._entries.popitem(last=False)  # least recently used

    def match(self, scope: str, hashes: Sequence[int]) -> dict[int, int]:
        """Replica -> how many leading blocks of `hashes` it was sent (replicas with none are absent)."""
        depth: dict[int, int] = {}
        live: set[int] | None = None
        for i, h in enumerate(hashes):
            holders = self._entries.get((scope, h))
            live = set() if not holders else (set(holders) if live is None else live & holders)
            if not live:
                break
            self._entries.move_to_end((scope, h))
            for r in live:
                depth[r] = i + 1
        return depth

    def forget_replica(self, replica: int) -> None:
        """The replica lost its cache (restarted, removed)."""
        for key in [k for k, holders in self._entries.items() if replica in holders]:
            holders = self._entries[key]
            holders.discard(replica)
            if not holders:
                del self._entries[key]
