"""The prefix-cache block hash: one definition for the engine's block manager and the gateway's
prefix index, so that a router's idea of "this prefix is cached there" names the same blocks.

A full block's hash is hash((parent hash, its token ids)); the first block's parent is a root that
depends on the model revision only. The root comes from a digest, not from Python's `hash` of a
string (salted per process), so every process computes the same chain for the same tokens.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence


def root_hash(extra_key: str) -> int:
    """The parent of a sequence's first block; `extra_key` (the model revision) keeps cache
    entries of different weights apart."""
    digest = hashlib.blake2b(b"meshserve-kv\0" + extra_key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def extend_chain(hashes: list[int], token_ids: Sequence[int], block_size: int, root: int,
                 num_full_blocks: int) -> list[int]:
    """Append to `hashes` (the chain of the first len(hashes) blocks) up to `num_full_blocks`."""
    while len(hashes) < num_full_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else root
        hashes.append(block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, root: int) -> list[int]:
    """The chain of every full block of `token_ids`."""
    return extend_chain([], token_ids, block_size, root, len(token_ids) // block_size)
