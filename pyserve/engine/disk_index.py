"""Puts the disk tier's block files, as the worker found them at start (Ready.disk_index), back
into the planner's radix tree as disk nodes, and queues the files that cannot be used for
deletion.

A file names its block's key, the key of the block before it and its tokens; the chains of
parent keys rebuild each cached sequence from its first block. A chain is used only if the
core's own keys for its tokens are the file keys (a file written by another key function is
never misread), and only within the disk budget; a file left out (an orphan whose parent is
gone, past the budget, a duplicate) is deleted by the first step, so the tier never holds
more than it indexes.
"""

from __future__ import annotations

import logging
from typing import Any

from pyserve.worker.disk_store import unpack_index

log = logging.getLogger("pyserve.engine")


def restore_disk_tier(planner: Any, packed: bytes, block_size: int) -> tuple[int, int]:
    """(blocks indexed, files queued for deletion)."""
    records = unpack_index(packed, block_size)
    if not records:
        return 0, 0
    by_key = {key: (parent, tokens) for key, parent, tokens in records}
    parents = {parent for _, parent, _ in records}
    cache = planner.cache
    for leaf in sorted(key for key in by_key if key not in parents):
        chain, key = [], leaf
        while key in by_key and len(chain) <= len(by_key):  # a cycle cannot be a chain
            chain.append(key)
            key = by_key[key][0]
        chain.reverse()
        tokens = [t for k in chain for t in by_key[k][1]]
        if cache.block_keys(tokens) != chain:
            continue  # an orphan (its first block's parent is not the root) or foreign keys
        cache.insert_disk(tokens)
    kept = set(cache.disk_keys())
    stale = [key for key in by_key if key not in kept]
    if stale:
        planner.drop_disk_files(stale)
    log.info(
        "disk cache: %d of %d block files indexed from an earlier run%s",
        len(kept),
        len(by_key),
        f"; deleting {len(stale)} that cannot be used" if stale else "",
    )
    return len(kept), len(stale)
