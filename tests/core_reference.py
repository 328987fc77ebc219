"""A small pure-Python model of ``pyserve._core`` (cpp/README.md), for tests and benchmarks.

Three classes with the same names and call signatures as the C++ core (``match_prefix`` and
``insert`` also take packed little-endian bytes, like the core). Where the core returns block ids
as packed int32 bytes (``BlockAllocator.allocate``, ``RadixCache.match_prefix``), the reference
returns lists, its natural form, so that caller code such as ``blocks + fresh`` works with both.

- ``BlockAllocator``: a free list and reference counts.
- ``RadixCache``: a tree over token ids whose edges hold whole blocks; LRU eviction of unlocked
  leaves by (last access, node id). Its prefix matches and block ids are meant to agree exactly
  with the C++ cache for the same sequence of calls.
- ``Planner``: waiting queue (fcfs/lpm/priority, with preemption of less important requests),
  running set, budgets, chunked prefill (never ending
  inside a request's whole spans), reservation, retraction, abort, overlapped steps and
  speculative verify entries, following the planning
  rules of cpp/README.md (including its reservation arithmetic). Node layout inside the cache
  may differ from the core's (the core extends a decoding request's leaf in place), so tests
  compare the two planners through the invariants a worker relies on, not step by step.

Everything here favours plain, obviously-correct code over speed: it is the "straightforward
Python implementation" that the core benchmark measures against.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

FREE, OWNED, CACHED = 0, 1, 2  # block_states() values


def _ints(values: bytes | bytearray | memoryview | Iterable[int], typecode: str) -> list[int]:
    """Accepts packed little-endian bytes (like the core) or a sequence of ints."""
    if isinstance(values, bytes | bytearray | memoryview):
        return array(typecode, bytes(values)).tolist()
    return list(values)


# --------------------------------------------------------------------------------------------
# BlockAllocator


class BlockAllocator:
    """A fixed pool of ``num_blocks`` blocks; a block is free exactly when its refcount is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, 2, ... first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise RuntimeError(f"out of blocks: asked for {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for block in ids:
            self._refcounts[block] = 1
        return ids

    def take(self, ids: Iterable[int]) -> None:
        """Marks the given free blocks allocated (to mirror another allocator's choices)."""
        for block in ids:
            if self._refcounts[block] != 0:
                raise RuntimeError(f"block {block} is not free")
            self._free.remove(block)
            self._refcounts[block] = 1

    def incref(self, ids: Iterable[int]) -> None:
        for block in ids:
            self._check(block)
            if self._refcounts[block] == 0:
                raise ValueError(f"incref of free block {block}")
            self._refcounts[block] += 1

    def decref(self, ids: Iterable[int]) -> None:
        for block in ids:
            self._check(block)
            if self._refcounts[block] == 0:
                raise ValueError(f"decref of free block {block}")
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcounts[block]

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")


# --------------------------------------------------------------------------------------------
# RadixCache


class _Node:
    __slots__ = ("blocks", "children", "id", "key", "keys", "last_access", "lock_ref", "parent")

    def __init__(self, node_id: int, parent: _Node | None, key: tuple, blocks: list[int]):
        self.id = node_id
        self.parent = parent
        self.key = key  # tokens on the edge into this node, a whole number of blocks
        self.blocks = blocks  # one block id per block_size tokens of key (RAM nodes)
        self.keys: list[tuple] | None = None  # a disk node's block keys: the prefix up to each
        self.children: dict[tuple, _Node] = {}  # keyed by the first block of the child's key
        self.lock_ref = 0
        self.last_access = 0

    @property
    def on_disk(self) -> bool:
        return self.keys is not None

    @property
    def num_blocks(self) -> int:
        return len(self.keys) if self.keys is not None else len(self.blocks)


class RadixCache:
    """Block-granular radix tree. The tree holds one allocator reference on each of its blocks.

    A match that ends inside an edge splits the edge there, so that a handle always names a
    node whose path is exactly the matched prefix (what ``lock`` protects).

    Edges are compared block by block, as SGLang's paged Python radix cache does.
    ``whole_edge_compare`` adds a CPython shortcut (one tuple comparison per fully matching
    edge); the benchmark reports that tuned variant separately.

    Disk tier (``set_disk_budget``): eviction turns an unlocked RAM node without RAM children
    into a disk node, whose block keys here are the token prefixes themselves (the core's are
    64-bit hashes of them: tests check the two name the same prefixes alike).
    """

    whole_edge_compare = False

    def __init__(self, block_size: int, allocator: BlockAllocator) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.allocator = allocator
        self._next_id = 1
        self._clock = 0
        self._root = _Node(0, None, (), [])
        self._root.lock_ref = 1  # never evicted
        self._nodes: dict[int, _Node] = {0: self._root}
        self.cached_blocks = 0
        self.evictable_blocks = 0  # blocks of nodes with lock_ref == 0
        self.disk_budget = 0
        self.disk_blocks = 0
        self._saves: list[tuple[int, tuple]] = []
        self._drops: list[tuple] = []
        self._stats = dict(
            hit_tokens=0,
            query_tokens=0,
            evicted_blocks=0,
            inserted_blocks=0,
            saved_blocks=0,
            loaded_blocks=0,
            disk_evicted_blocks=0,
        )

    # -- lookups ------------------------------------------------------------------------------

    def match_prefix(
        self, tokens: Sequence[int] | bytes, count_stats: bool = True
    ) -> tuple[int, list[int], int]:
        key = tuple(_ints(tokens, "i"))
        self._clock += 1
        node, matched, blocks, _ = self._walk(key)
        if count_stats:
            self._stats["query_tokens"] += len(key)
            self._stats["hit_tokens"] += matched
        return matched, blocks, node.id

    def peek_prefix(self, tokens: Sequence[int] | bytes) -> tuple[int, int, int]:
        """(RAM blocks matched, of which unlocked, disk blocks right after); changes nothing."""
        key = tuple(_ints(tokens, "i"))
        key = key[: len(key) - len(key) % self.block_size]
        node, pos, unlocked = self._root, 0, 0
        while (child := self._child(node, key, pos)) is not None and not child.on_disk:
            n = self._edge_match(child, key, pos)
            unlocked += n if child.lock_ref == 0 else 0
            pos += n * self.block_size
            if n < child.num_blocks:
                return pos // self.block_size, unlocked, 0
            node = child
        ram = pos
        while (child := self._child(node, key, pos)) is not None and child.on_disk:
            n = self._edge_match(child, key, pos)
            pos += n * self.block_size
            if n < child.num_blocks:
                break
            node = child
        return ram // self.block_size, unlocked, (pos - ram) // self.block_size

    def _child(self, node: _Node, key: tuple, pos: int) -> _Node | None:
        return node.children.get(key[pos : pos + self.block_size]) if pos < len(key) else None

    def _edge_match(self, child: _Node, key: tuple, pos: int) -> int:
        """Leading blocks of child's edge equal to key[pos:] (the first is known to match)."""
        bs, n = self.block_size, 1
        while n < child.num_blocks and pos + (n + 1) * bs <= len(key):
            if child.key[n * bs : (n + 1) * bs] != key[pos + n * bs : pos + (n + 1) * bs]:
                break
            n += 1
        return n

    def _walk(self, key: tuple, through_disk: bool = False) -> tuple[_Node, int, list[int], int]:
        """Follows key down the tree (splitting a partly matched edge); touches the path.

        Returns the last node, tokens matched, the RAM blocks, and the tokens matched in RAM
        (the walk stops before the first disk node unless through_disk).
        """
        bs = self.block_size
        usable = len(key) - len(key) % bs
        node, pos, blocks, ram_pos = self._root, 0, [], None
        while pos < usable:
            child = node.children.get(key[pos : pos + bs])
            if child is None:
                break
            if child.on_disk:
                if not through_disk:
                    break
                ram_pos = pos if ram_pos is None else ram_pos
            n = 1  # the first block matched through the dict key
            edge = len(child.key)
            whole = self.whole_edge_compare and pos + edge <= usable
            if whole and child.key == key[pos : pos + edge]:
                n = child.num_blocks
            while n < child.num_blocks and pos + (n + 1) * bs <= usable:
                start = pos + n * bs
                if child.key[n * bs : (n + 1) * bs] != key[start : start + bs]:
                    break
                n += 1
            if n < child.num_blocks:
                child = self._split(child, n)
            child.last_access = self._clock
            blocks.extend(child.blocks)
            pos += len(child.key)
            node = child
        return node, pos, blocks, pos if ram_pos is None else ram_pos

    def _split(self, child: _Node, n: int) -> _Node:
        """Cuts child's edge after n blocks; returns the new upper node."""
        bs = self.block_size
        parent = child.parent
        upper = _Node(self._next_id, parent, child.key[: n * bs], child.blocks[:n])
        self._next_id += 1
        self._nodes[upper.id] = upper
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[upper.key[:bs]] = upper
        if child.on_disk:
            upper.keys, child.keys = child.keys[:n], child.keys[n:]
        child.key = child.key[n * bs :]
        child.blocks = child.blocks[n:]
        child.parent = upper
        upper.children[child.key[:bs]] = child
        return upper

    def _prefix(self, node: _Node) -> tuple:
        parts = []
        while node is not self._root:
            parts.append(node.key)
            node = node.parent
        return tuple(t for part in reversed(parts) for t in part)

    # -- updates ------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int] | bytes, block_ids: Sequence[int] | bytes) -> int:
        return self.insert_with_loads(tokens, block_ids)[0]

    def insert_with_loads(
        self, tokens: Sequence[int] | bytes, block_ids: Sequence[int] | bytes
    ) -> tuple[int, list[tuple[int, tuple]]]:
        """insert; disk nodes on the path come back to RAM in the given blocks (the loads)."""
        bs = self.block_size
        key = _ints(tokens, "i")
        key = tuple(key[: len(key) - len(key) % bs])
        blocks = _ints(block_ids, "i")
        if len(blocks) < len(key) // bs:
            raise ValueError(f"{len(blocks)} block ids for {len(key) // bs} blocks of tokens")
        blocks = blocks[: len(key) // bs]
        self._clock += 1
        node, matched, _, cached = self._walk(key, through_disk=True)
        loads: list[tuple[int, tuple]] = []
        path = []
        x = node
        while x.on_disk:
            path.append(x)
            x = x.parent
        for d in reversed(path):
            first = (len(self._prefix(d)) - len(d.key)) // bs
            ids = blocks[first : first + len(d.keys)]
            loads.extend(zip(ids, d.keys, strict=True))
            self.allocator.incref(ids)
            d.blocks, d.keys = ids, None
            self.cached_blocks += len(ids)
            self.evictable_blocks += len(ids)
            self.disk_blocks -= len(ids)
            self._stats["loaded_blocks"] += len(ids)
        if matched < len(key):
            new_blocks = blocks[matched // bs :]
            leaf = _Node(self._next_id, node, key[matched:], new_blocks)
            self._next_id += 1
            self._nodes[leaf.id] = leaf
            leaf.last_access = self._clock
            node.children[leaf.key[:bs]] = leaf
            self.allocator.incref(new_blocks)
            self.cached_blocks += len(new_blocks)
            self.evictable_blocks += len(new_blocks)
            self._stats["inserted_blocks"] += len(new_blocks)
        return cached, loads

    def set_disk_budget(self, max_blocks: int) -> None:
        if max_blocks < 0:
            raise ValueError(f"disk budget must be >= 0, got {max_blocks}")
        self.disk_budget = max_blocks
        self._trim_disk(max_blocks)

    def insert_disk(self, tokens: Sequence[int] | bytes) -> int:
        """Adds the whole blocks of tokens not in the tree as disk nodes, within the budget."""
        bs = self.block_size
        key = _ints(tokens, "i")
        key = tuple(key[: len(key) - len(key) % bs])
        node, matched = self._root, 0
        while (child := self._child(node, key, matched)) is not None:
            n = self._edge_match(child, key, matched)
            matched += n * bs
            if n < child.num_blocks:
                break
            node = child
        count = min((len(key) - matched) // bs, self.disk_budget - self.disk_blocks)
        if count <= 0:
            return 0
        self._clock += 1
        node, matched, _, _ = self._walk(key, through_disk=True)
        new_key = key[matched : matched + count * bs]
        leaf = _Node(self._next_id, node, new_key, [])
        self._next_id += 1
        self._nodes[leaf.id] = leaf
        leaf.last_access = self._clock
        leaf.keys = [key[: matched + (i + 1) * bs] for i in range(count)]
        node.children[new_key[:bs]] = leaf
        self.disk_blocks += count
        return count

    def forget_disk(self, handle: int, tokens: Sequence[int]) -> int:
        """Forgets the disk child of the node whose edge starts with tokens' first block, and
        everything below it (their files dropped); returns the disk blocks forgotten."""
        node = self._node(handle)
        child = node.children.get(tuple(tokens[: self.block_size]))
        if child is None or not child.on_disk:
            return 0
        before = self.disk_blocks
        self._forget_subtree(child)
        return before - self.disk_blocks

    def _forget_subtree(self, node: _Node) -> None:
        for child in list(node.children.values()):
            self._forget_subtree(child)
        self._drop_files(node.keys)
        self._remove(node)

    def _drop_files(self, keys: list[tuple]) -> None:
        """Drops the files of keys, after any save of them not yet taken (a load in the same
        step may read it first)."""
        self._drops.extend(keys)

    def disk_keys(self) -> list[tuple]:
        return [k for n in self._nodes.values() if n.on_disk for k in n.keys]

    def queue_drops(self, keys: list[tuple]) -> None:
        self._drops.extend(keys)

    def depth(self, handle: int) -> int:
        return len(self._prefix(self._node(handle)))

    def path_blocks(self, handle: int) -> list[int]:
        node, parts = self._node(handle), []
        while node is not self._root:
            parts.append(node.blocks)
            node = node.parent
        return [b for part in reversed(parts) for b in part]

    def take_saves(self) -> list[tuple[int, tuple]]:
        out, self._saves = self._saves, []
        return out

    def take_drops(self) -> list[tuple]:
        out, self._drops = self._drops, []
        return out

    def lock(self, handle: int) -> None:
        node = self._node(handle)
        if node.on_disk:
            raise ValueError(f"cannot lock disk node {handle}")
        while node is not self._root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: int) -> None:
        node = self._node(handle)
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        if any(n.lock_ref == 0 for n in path):
            raise ValueError(f"unlock of node {handle} that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_blocks += len(n.blocks)

    def evict(self, num_blocks: int) -> int:
        if num_blocks < 0:
            raise ValueError(f"cannot evict {num_blocks} blocks")
        released = 0
        while released < num_blocks:
            frontier = [
                n
                for n in self._nodes.values()
                if n.lock_ref == 0
                and not n.on_disk
                and not any(not c.on_disk for c in n.children.values())
            ]
            if not frontier:
                break
            victim = min(frontier, key=lambda n: (n.last_access, n.id))
            if self.disk_budget == 0:
                released += self._remove(victim)
            else:
                released += self._to_disk(victim)
                self._trim_disk(self.disk_budget)
        return released

    def _to_disk(self, node: _Node) -> int:
        before = self.allocator.num_free
        prefix = self._prefix(node.parent)
        bs = self.block_size
        keys = [prefix + node.key[: (i + 1) * bs] for i in range(len(node.blocks))]
        self._saves.extend(zip(node.blocks, keys, strict=True))
        self.allocator.decref(node.blocks)
        n = len(node.blocks)
        self.cached_blocks -= n
        self.evictable_blocks -= n
        self.disk_blocks += n
        self._stats["evicted_blocks"] += n
        self._stats["saved_blocks"] += n
        node.blocks, node.keys = [], keys
        return self.allocator.num_free - before

    def _trim_disk(self, max_blocks: int) -> None:
        while self.disk_blocks > max_blocks:
            leaves = [n for n in self._nodes.values() if n.on_disk and not n.children]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: (n.last_access, n.id))
            self._drop_files(victim.keys)
            self._remove(victim)

    def reset(self) -> int:
        """Drops every unlocked node and every disk node; returns the blocks released."""
        before = self.allocator.num_free
        for node in list(self._nodes.values()):
            if node.id in self._nodes and node.lock_ref == 0:
                self._drop_subtree(node)
        self._saves, self._drops = [], []
        return self.allocator.num_free - before

    def _drop_subtree(self, node: _Node) -> None:
        for child in list(node.children.values()):
            self._drop_subtree(child)
        self._remove(node)

    def _remove(self, node: _Node) -> int:
        """Detaches an unlocked leaf and drops the tree's references; returns blocks freed."""
        before = self.allocator.num_free
        del node.parent.children[node.key[: self.block_size]]
        del self._nodes[node.id]
        if node.on_disk:
            self.disk_blocks -= len(node.keys)
            self._stats["disk_evicted_blocks"] += len(node.keys)
            return 0
        self.allocator.decref(node.blocks)
        self.cached_blocks -= len(node.blocks)
        self.evictable_blocks -= len(node.blocks)
        self._stats["evicted_blocks"] += len(node.blocks)
        return self.allocator.num_free - before

    def _node(self, handle: int) -> _Node:
        node = self._nodes.get(handle)
        if node is None:
            raise ValueError(f"unknown cache node {handle}")
        return node

    # -- inspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        return dict(
            cached_blocks=self.cached_blocks,
            evictable_blocks=self.evictable_blocks,
            disk_blocks=self.disk_blocks,
            disk_budget=self.disk_budget,
            **self._stats,
        )

    def cached_block_ids(self) -> set[int]:
        return {b for n in self._nodes.values() for b in n.blocks}


# --------------------------------------------------------------------------------------------
# Planner


@dataclass
class Step:
    """One planned forward pass, with the same packed fields as ``pyserve._core.Step``."""

    step_id: int
    rids: bytes
    start_pos: bytes
    num_tokens: bytes
    is_decode: bytes
    sample: bytes
    input_ids: bytes
    block_offsets: bytes
    block_counts: bytes
    block_ids: bytes
    dropped: bytes
    retracted: bytes
    num_prefill_tokens: int
    num_decode_tokens: int
    # The disk tier's ops; the keys are the reference's (token prefixes), so not packed.
    save_blocks: bytes = b""
    save_keys: list = field(default_factory=list)
    save_parents: list = field(default_factory=list)  # the key before each save (() first)
    save_tokens: bytes = b""
    load_blocks: bytes = b""
    load_keys: list = field(default_factory=list)
    drop_keys: list = field(default_factory=list)
    clear_disk: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.rids) // 8

    def entries(self) -> list[dict]:
        rids = array("q", self.rids)
        starts, counts = array("i", self.start_pos), array("i", self.num_tokens)
        decode, sample = self.is_decode, self.sample
        offsets, nblocks = array("i", self.block_offsets), array("i", self.block_counts)
        tokens, blocks = array("i", self.input_ids).tolist(), array("i", self.block_ids).tolist()
        out, t, b = [], 0, 0
        for i, rid in enumerate(rids):
            n_in = counts[i] - 1 if decode[i] else counts[i]  # a decode's inputs: its drafts
            ids = tokens[t : t + n_in]
            t += len(ids)
            out.append(
                dict(
                    rid=rid,
                    start_pos=starts[i],
                    num_tokens=counts[i],
                    is_decode=bool(decode[i]),
                    sample=bool(sample[i]),
                    input_ids=ids,
                    block_offset=offsets[i],
                    block_ids=blocks[b : b + nblocks[i]],
                )
            )
            b += nblocks[i]
        return out


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    priority: int = 0  # lower runs first (the priority policy)
    tenant: int = 0  # whose request (tenant fairness)
    # False: admissions compute every position (no cached prefix), and its blocks never enter
    # the cache (they would duplicate cached ones, both held while it runs)
    match_prefix: bool = True
    # [start, end) pairs of prompt positions that no prefill chunk ends strictly inside
    whole_spans: list[tuple[int, int]] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | retracted | done
    table: list[int] = field(default_factory=list)  # one allocator reference held per entry
    handle: int = 0  # the locked cache node; its path covers positions [0, tree_len)
    tree_len: int = 0
    prefill_target: int = 0  # prompt + output known at admission
    num_scheduled: int = 0  # positions computed or planned
    num_computed: int = 0  # positions computed by reported steps
    planned_samples: int = 0
    cached_tokens: int = 0
    admitted_once: bool = False
    inflight: int = 0  # unreported steps that contain this request
    draft: list[int] = field(default_factory=list)  # for the next plan() (set_draft)
    verifying: list[int] = field(default_factory=list)  # drafts of an unreported verify entry
    spec_drafted: int = 0  # drafts of its reported verify entries
    spec_accepted: int = 0  # of which accepted
    loading: list[int] = field(default_factory=list)  # blocks a step fills from disk for it
    served_to: int = 0  # tenant fairness: its positions below this were counted served
    load_handle: int | None = None  # the cache node it locks while loading and until admitted

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


_POLICIES = ("fcfs", "lpm", "priority")


class Planner:
    """The planning rules of cpp/README.md, written for clarity, not speed."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_running_requests: int = 256,
        max_prefill_tokens: int = 8192,
        chunked_prefill_size: int = 2048,
        policy: str = "fcfs",
        enable_radix_cache: bool = True,
        vocab_size: int = 2**31 - 1,
        init_reserve_ratio: float = 0.7,
        min_reserve_ratio: float = 0.1,
        reserve_decay: float = 0.001,
        max_draft_tokens: int = 0,
        tenant_fairness: bool = False,
        fairness_quantum: int = 4096,
        disk_budget_blocks: int = 0,
    ) -> None:
        for name, value in dict(
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            vocab_size=vocab_size,
        ).items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if not 0 <= min_reserve_ratio <= init_reserve_ratio <= 1 or reserve_decay < 0:
            raise ValueError("reserve ratios must satisfy 0 <= min <= init <= 1, decay >= 0")
        if tenant_fairness and policy != "fcfs":
            raise ValueError("tenant_fairness needs the fcfs policy")
        if fairness_quantum < 0:
            raise ValueError(f"fairness_quantum must be >= 0, got {fairness_quantum}")
        if not 0 <= max_draft_tokens <= 65536:
            raise ValueError(f"max_draft_tokens must be in [0, 65536], got {max_draft_tokens}")
        self.allocator = BlockAllocator(num_blocks)
        self.cache = RadixCache(block_size, self.allocator)
        if disk_budget_blocks and not enable_radix_cache:
            raise ValueError("disk_budget_blocks needs the radix cache")
        self.cache.set_disk_budget(disk_budget_blocks)
        self.block_size = block_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = policy
        self.enable_radix_cache = enable_radix_cache
        self.vocab_size = vocab_size
        self.init_reserve_ratio = init_reserve_ratio
        self.min_reserve_ratio = min_reserve_ratio
        self.reserve_decay = reserve_decay
        self.reserve_ratio = init_reserve_ratio
        self.max_draft_tokens = max_draft_tokens
        self.tenant_fairness = tenant_fairness
        self.fairness_quantum = fairness_quantum
        self._served: dict[int, int] = {}  # tenant -> tokens planned for it (lifted on return)
        self._live: dict[int, int] = {}  # tenant -> its requests not yet ended
        self._requests: dict[int, _Request] = {}
        # by (priority, arrival); a retracted request goes ahead of the waiting ones of its class
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # by (priority, admission); the last goes first
        # (step id, [(request, end, samples, drafts)])
        self._inflight: deque[tuple[int, list[tuple[_Request, int, bool, int]]]] = deque()
        self._dropped: list[int] = []
        self._next_step = 0
        self.retractions = 0
        self.fairness_retractions = 0  # of which to make room for a less-served tenant
        self._fair_head: _Request | None = None  # the request they made room for, in a plan
        self.spec_verify_entries = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_histogram = [0] * (max_draft_tokens + 1)
        self._step_loads: dict[int, list[_Request]] = {}  # step id -> requests loading in it
        self._step_load_blocks: dict[int, set[int]] = {}  # step id -> the blocks they fill
        self._failed_loads: list[int] = []  # fail_loads for the oldest step
        self._pending_loads: tuple[list[int], list[tuple]] = ([], [])  # the plan's
        self._clear_disk = False
        self.disk_loaded_blocks = self.disk_failed_blocks = 0

    # -- requests in and out ------------------------------------------------------------------

    def add_request(
        self,
        rid: int,
        prompt: Sequence[int] | bytes,
        max_new_tokens: int,
        *,
        match_prefix: bool = True,
        whole_spans: Sequence[int] | bytes = b"",
        priority: int = 0,
        tenant: int = 0,
    ) -> None:
        tokens = _ints(prompt, "i")
        if rid in self._requests:
            raise ValueError(f"request {rid} already exists")
        if priority and self.policy != "priority":
            raise ValueError(f"request {rid}: a priority needs the priority policy")
        if tenant < 0 or (tenant and not self.tenant_fairness):
            raise ValueError(f"request {rid}: tenant {tenant} is negative or needs fairness")
        if not tokens:
            raise ValueError(f"request {rid}: empty prompt")
        self._check_tokens(tokens)
        if max_new_tokens < 1:
            raise ValueError(f"request {rid}: max_new_tokens must be >= 1, got {max_new_tokens}")
        capacity = self.allocator.num_blocks * self.block_size
        flat = _ints(whole_spans, "i")
        if len(flat) % 2:
            raise ValueError(f"request {rid}: whole_spans holds {len(flat)} ints, not pairs")
        spans = list(zip(flat[::2], flat[1::2], strict=True))
        for i, (s, e) in enumerate(spans):
            if not 0 <= s < e <= len(tokens):
                raise ValueError(f"request {rid}: whole_spans[{i}] = [{s}, {e}) is not a range")
            if i and s < spans[i - 1][1]:
                raise ValueError(f"request {rid}: whole_spans[{i}] overlaps the span before it")
            if self._blocks_for(e) > self.allocator.num_blocks:
                raise ValueError(f"request {rid}: whole_spans[{i}] needs more than the pool")
        if len(tokens) + max_new_tokens > capacity:
            raise ValueError(
                f"request {rid}: {len(tokens)} + {max_new_tokens} tokens exceed the pool "
                f"({capacity} tokens)"
            )
        req = _Request(rid, tokens, max_new_tokens, priority, tenant, match_prefix, spans)
        self._requests[rid] = req
        if self.tenant_fairness:
            if not self._live.get(tenant):  # back from idle: banks no credit
                live = [self._served[t] for t, n in self._live.items() if n]
                self._served.setdefault(tenant, 0)
                if live:
                    self._served[tenant] = max(self._served[tenant], min(live))
            self._live[tenant] = self._live.get(tenant, 0) + 1
        # behind every waiting request of its priority or a smaller value
        at = len(self._waiting)
        while at and self._waiting[at - 1].priority > priority:
            at -= 1
        self._waiting.insert(at, req)

    def finish(self, rid: int) -> None:
        req = self._requests.get(rid)
        if req is None or req.state == "done":
            raise KeyError(f"request {rid} is unknown or already finished")
        self._end(req)

    def abort(self, rid: int) -> bool:
        req = self._requests.get(rid)
        if req is None or req.state == "done":
            return False
        self._end(req)
        return True

    def _end(self, req: _Request) -> None:
        # Its computed whole blocks are in the cache already (report put them there).
        if req.state == "running":
            self._release(req)
            self._running.remove(req)
        else:
            self._waiting.remove(req)
            self._drop_load(req)
        req.state = "done"
        if self.tenant_fairness:
            self._live[req.tenant] -= 1
        self._dropped.append(req.rid)
        if req.inflight == 0:
            del self._requests[req.rid]

    def flush_cache(self) -> int:
        self._clear_disk = self.cache.disk_budget > 0
        return self.cache.reset()

    def spill_to_disk(self) -> int:
        if not self.cache.disk_budget:
            return 0
        before = self.cache.stats()["saved_blocks"]
        self.cache.evict(2**62)
        return self.cache.stats()["saved_blocks"] - before

    def drop_disk_files(self, keys: list) -> None:
        self.cache.queue_drops(list(keys))

    def fail_loads(self, step_id: int, blocks: Sequence[int] | bytes) -> None:
        if not self._inflight or self._inflight[0][0] != step_id:
            raise RuntimeError(f"fail_loads for step {step_id}, not the oldest unreported")
        loaded = self._step_load_blocks.get(step_id, set())
        ids = _ints(blocks, "i")
        for b in ids:
            if b not in loaded:
                raise ValueError(f"fail_loads for step {step_id}: block {b} is not a load")
        self._failed_loads.extend(ids)

    def _start_load(self, req: _Request) -> None:
        tokens = req.tokens
        matched, _, handle = self.cache.match_prefix(tokens[:-1], count_stats=False)
        self.cache.lock(handle)
        if req.load_handle is not None:
            self.cache.unlock(req.load_handle)
        req.load_handle = handle
        disk = self.cache.peek_prefix(tokens[:-1])[2]
        if not self._allocate(disk, req.loading):
            raise RuntimeError("a load counted the blocks available but could not allocate")
        bs = self.block_size
        self._pending_loads[0].extend(req.loading)
        self._pending_loads[1].extend(tuple(tokens[: matched + (i + 1) * bs]) for i in range(disk))
        req.inflight += 1
        self._loading_now.append(req)

    def _drop_load(self, req: _Request) -> None:
        self.allocator.decref(req.loading)
        req.loading = []
        if req.load_handle is not None:
            self.cache.unlock(req.load_handle)
        req.load_handle = None

    def _finish_loads(self, loads: list[_Request], failed: set[int]) -> None:
        bs = self.block_size
        for req in loads:
            req.inflight -= 1
            if req.state == "done":
                continue
            good = 0
            while good < len(req.loading) and req.loading[good] not in failed:
                good += 1
            tokens = req.tokens
            if good:
                base = self.cache.depth(req.load_handle)
                ids = self.cache.path_blocks(req.load_handle) + req.loading[:good]
                self.cache.insert(tokens[: base + good * bs], ids)
                _, _, handle = self.cache.match_prefix(tokens[: base + good * bs], False)
                self.cache.lock(handle)
                self.cache.unlock(req.load_handle)
                req.load_handle = handle
            if good < len(req.loading):
                at = self.cache.depth(req.load_handle)
                self.cache.forget_disk(req.load_handle, tokens[at : at + bs])
                self.disk_failed_blocks += len(req.loading) - good
            self.disk_loaded_blocks += good
            self.allocator.decref(req.loading)
            req.loading = []

    def set_draft(self, rid: int, draft: Sequence[int] | bytes) -> None:
        """Drafts for the request's next decode entry to verify; an empty draft clears."""
        tokens = _ints(draft, "i")
        req = self._requests.get(rid)
        if req is None or req.state == "done":
            raise KeyError(f"set_draft: request {rid} is unknown or already finished")
        if not tokens:
            req.draft = []
            return
        if req.state != "running" or req.num_scheduled < req.prefill_target:
            raise ValueError(f"set_draft: request {rid} is not decoding")
        if req.verifying:
            raise ValueError(f"set_draft: request {rid} still awaits its verify report")
        if len(tokens) > self.max_draft_tokens:
            raise ValueError(f"set_draft: {len(tokens)} drafts > {self.max_draft_tokens}")
        self._check_tokens(tokens)
        if req.planned_samples + 1 + len(tokens) > req.max_new_tokens:
            raise ValueError(f"set_draft: request {rid}'s drafts could pass max_new_tokens")
        req.draft = tokens

    # -- blocks -------------------------------------------------------------------------------

    def _available(self) -> int:
        return self.allocator.num_free + (self.cache.evictable_blocks * self.enable_radix_cache)

    def _allocate(self, n: int, table: list[int]) -> bool:
        if n <= 0:
            return True
        if n > self.allocator.num_free and self.enable_radix_cache:
            self.cache.evict(n - self.allocator.num_free)
        if n > self.allocator.num_free:
            return False
        table.extend(self.allocator.allocate(n))
        return True

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _future_blocks(self, req: _Request) -> int:
        """Blocks req may still need: the rest of its prefill and a share of its samples."""
        remaining = max(0, req.max_new_tokens - req.planned_samples)
        final = max(req.prefill_target, req.num_scheduled)
        final += math.ceil(remaining * self.reserve_ratio)
        return max(0, self._blocks_for(final) - len(req.table))

    @staticmethod
    def _span_end(req: _Request, start: int, end: int, limit: int) -> int:
        """Where a prefill chunk from ``start`` ends, given the end the budgets allow and the
        furthest end the pool holds now: a chunk starting in a span (or at its start) runs to
        the span's end even past the budgets; one that would end strictly inside a later span
        ends at its start; ``start`` (nothing now) when the pool cannot hold the span."""
        for s, e in req.whole_spans:
            if s <= start < e:
                end = max(end, e)
        end = min(end, limit)
        for s, e in req.whole_spans:
            if s < end < e:
                return s if s > start else start
        return end

    def _release(self, req: _Request) -> None:
        self.allocator.decref(req.table)
        if self.enable_radix_cache:
            self.cache.unlock(req.handle)
        req.table, req.handle, req.tree_len = [], 0, 0
        req.num_scheduled = req.num_computed = req.prefill_target = 0
        req.draft = []

    # -- the plan -----------------------------------------------------------------------------

    def plan(self) -> Step | None:
        entries: list[tuple[_Request, int, int, bool, int]] = []
        self._loading_now: list[_Request] = []
        self._pending_loads = ([], [])
        self._fair_head = None
        if self.policy == "priority":
            retracted = self._preempt()
        else:
            retracted = self._preempt_for_fairness() if self.tenant_fairness else []
        preempted = len(retracted)
        self._plan_decodes(entries, retracted)
        budget = self._plan_chunks(entries, self.max_prefill_tokens)
        # like the core: memory ran short, admitting now invites a retraction
        memory_short = len(retracted) > preempted
        if not memory_short:
            self._admit(entries, budget)
        saves, drops = self.cache.take_saves(), self.cache.take_drops()
        load_blocks, load_keys = self._pending_loads
        clear, self._clear_disk = self._clear_disk, False
        if (
            not entries
            and not self._dropped
            and not retracted
            and not saves
            and not drops
            and not load_blocks
            and not clear
        ):
            return None
        if not memory_short:
            self.reserve_ratio = max(
                self.min_reserve_ratio, self.reserve_ratio - self.reserve_decay
            )
        step = self._emit(entries, retracted)
        step.save_blocks = array("i", [b for b, _ in saves]).tobytes()
        step.save_keys = [k for _, k in saves]
        bs = self.block_size
        step.save_parents = [k[:-bs] for _, k in saves]
        step.save_tokens = array("i", [t for _, k in saves for t in k[-bs:]]).tobytes()
        step.load_blocks = array("i", load_blocks).tobytes()
        step.load_keys = load_keys
        step.drop_keys = drops
        step.clear_disk = clear
        if self._loading_now:
            self._step_loads[step.step_id] = self._loading_now
            self._step_load_blocks[step.step_id] = set(load_blocks)
        return step

    def _decode_eligible(self, req: _Request) -> bool:
        """Decoding, samples left, and not waiting for a verify result (its next input)."""
        return (
            req.state == "running"
            and req.num_scheduled >= req.prefill_target
            and req.planned_samples < req.max_new_tokens
            and not req.verifying
        )

    def _plain_blocks(self, req: _Request) -> int:
        return int(req.num_scheduled // self.block_size >= len(req.table))

    def _plan_decodes(self, entries: list, retracted: list[int]) -> None:
        """One token for each running request whose prefill is planned, plus its drafts when
        they fit beside the plain decodes still to plan (drafts never cause a retraction);
        oldest first, so that the victims of a retraction (newest first) have no entry in this
        step yet."""
        plain_left = sum(self._plain_blocks(r) for r in self._running if self._decode_eligible(r))
        for req in list(self._running):
            if not self._decode_eligible(req):
                continue
            plain_left -= self._plain_blocks(req)
            old_len = len(req.table)
            if req.draft:
                k = len(req.draft)
                extra = self._blocks_for(req.num_scheduled + 1 + k) - old_len
                if not retracted and self._available() >= extra + plain_left:
                    self._allocate(extra, req.table)
                    drafts, req.draft = req.draft, []
                    req.verifying = drafts
                    entries.append(self._schedule(req, 1 + k, True, old_len, drafts))
                    continue
                req.draft = []  # a plain decode instead
            if req.num_scheduled // self.block_size >= old_len:
                while not self._allocate(1, req.table):
                    victim = next(
                        r for r in reversed(self._running) if r.planned_samples < r.max_new_tokens
                    )
                    self._retract(victim, memory_short=True)
                    retracted.append(victim.rid)
                    if victim is req:
                        break
                if req.state != "running":
                    continue
            entries.append(self._schedule(req, 1, True, old_len))

    def _plan_chunks(self, entries: list, budget: int) -> int:
        """The next chunk of every admitted request whose prefill is not fully planned, cut to
        the blocks available now (it never waits and never retracts)."""
        bs = self.block_size
        for req in self._running:
            if req.num_scheduled >= req.prefill_target:
                continue
            if budget <= 0:
                break
            start = req.num_scheduled
            n = min(req.prefill_target - start, self.chunked_prefill_size, budget)
            fits = (len(req.table) + self._available()) * bs - start
            n = self._span_end(req, start, start + n, start + fits) - start
            if n <= 0:
                continue
            old_len = len(req.table)
            self._allocate(self._blocks_for(req.num_scheduled + n) - old_len, req.table)
            entries.append(self._schedule(req, n, False, old_len))
            budget -= n
        return budget

    def _admit(self, entries: list, budget: int) -> None:
        """Admits waiting requests in policy order; stops at the first that does not fit.
        Stopped for lack of blocks, it unlocks the loaded prefixes of the other waiting ones, and
        if it unlocked any, admits once more (the one it stopped at may fit now)."""
        for _ in range(2):
            before = len(entries)
            stop = self._admit_until(entries, budget)
            budget -= sum(entry[2] for entry in entries[before:])
            if stop is False:
                return
            released = 0
            for req in self._waiting:
                if req is not stop and not req.inflight and req.load_handle is not None:
                    self.cache.unlock(req.load_handle)
                    req.load_handle = None
                    released += 1
            if not released:
                return

    def _admit_until(self, entries: list, budget: int) -> _Request | bool | None:
        """The request where admission stopped for lack of blocks (None: before any), or
        False when it did not."""
        if not self._waiting or budget <= 0 or len(self._running) >= self.max_running_requests:
            return False
        reserved = sum(self._future_blocks(r) for r in self._running)
        if self._available() <= reserved:
            return None
        for req in self._admission_candidates():
            if budget <= 0 or len(self._running) >= self.max_running_requests:
                return False
            if req.inflight or len(req.output) >= req.max_new_tokens:
                continue  # a retracted request still in flight, or one awaiting its finish
            tokens = req.tokens
            target = len(tokens)
            matched, n, blocks_now, blocks_later, shortfall = self._admit_cost(
                req, budget, reserved
            )
            if req.match_prefix and self.enable_radix_cache:
                _, unlocked, disk = self.cache.peek_prefix(tokens[:-1])
                if disk:  # load it first
                    if reserved + disk > self._available() - unlocked:
                        return req
                    self._start_load(req)
                    continue
            if shortfall > 0:
                return req
            self._waiting.remove(req)
            if self.enable_radix_cache and not req.match_prefix:
                self.cache.lock(0)  # the root: every running request holds one lock
                req.table, req.handle, req.tree_len = [], 0, 0
            elif self.enable_radix_cache:
                matched, blocks, handle = self.cache.match_prefix(tokens[:-1])
                self.cache.lock(handle)
                if req.load_handle is not None:  # the loaded prefix, locked until now
                    self.cache.unlock(req.load_handle)
                    req.load_handle = None
                self.allocator.incref(blocks)
                req.table, req.handle, req.tree_len = list(blocks), handle, matched
            self._allocate(blocks_now, req.table)
            req.state = "running"
            req.prefill_target = target
            req.num_scheduled = req.num_computed = matched
            req.planned_samples = len(req.output)
            if not req.admitted_once:
                req.cached_tokens, req.admitted_once = matched, True
            self._insert_running(req)
            entries.append(self._schedule(req, n, False, 0))
            budget -= n
            reserved += blocks_later
        return False

    def _admit_cost(self, req: _Request, budget: int, reserved: int) -> tuple[int, ...]:
        """(matched, chunk, blocks now, blocks later, blocks short beside ``reserved``)."""
        tokens = req.tokens
        target = len(tokens)
        # Match at most target - 1 tokens: a prefill computes at least one token.
        matched, unlocked = self._peek(tokens[:-1]) if req.match_prefix else (0, 0)
        n = min(target - matched, self.chunked_prefill_size, budget)
        n = self._span_end(req, matched, matched + n, target) - matched
        blocks_now = self._blocks_for(matched + n) - matched // self.block_size
        later_tokens = target + math.ceil(
            (req.max_new_tokens - len(req.output)) * self.reserve_ratio
        )
        blocks_later = max(0, self._blocks_for(later_tokens) - self._blocks_for(matched + n))
        shortfall = reserved + blocks_now + blocks_later - (self._available() - unlocked)
        return matched, n, blocks_now, blocks_later, shortfall

    def _insert_running(self, req: _Request) -> None:
        at = len(self._running)
        while at and self._running[at - 1].priority > req.priority:
            at -= 1
        self._running.insert(at, req)

    def _room_needed(self, head: _Request) -> int | None:
        """Blocks admitting ``head`` now lacks (<= 0: none, but a running slot is missing), or
        None when it can be admitted."""
        reserved = sum(self._future_blocks(r) for r in self._running)
        shortfall = self._admit_cost(head, self.max_prefill_tokens, reserved)[-1]
        if shortfall <= 0 and len(self._running) < self.max_running_requests:
            return None
        return shortfall

    def _make_room(self, candidates: list[_Request], shortfall: int) -> list[int]:
        """Retracts the first candidates, in order, that make room (a slot, and ``shortfall``
        blocks by those they would give back); none if all of them would not."""
        cached = self.cache.cached_block_ids() if self.enable_radix_cache else set()
        victims, freed = [], 0
        for v in candidates:
            if victims and freed >= shortfall:
                break
            victims.append(v)
            freed += self._future_blocks(v) + sum(
                self.allocator.refcount(b) == 1 or (self.allocator.refcount(b) == 2 and b in cached)
                for b in v.table
            )
        if not victims or freed < shortfall:
            return []
        for v in victims:
            self._retract(v, memory_short=False)
        return [v.rid for v in victims]

    def _preempt(self) -> list[int]:
        """The first admissible waiting request, short of blocks or of a running slot, retracts
        running requests of a larger priority value, last in the running order first, as many
        as make room by the blocks they would give back; none if all of them would not."""
        head = next(
            (r for r in self._waiting if not r.inflight and len(r.output) < r.max_new_tokens),
            None,
        )
        if head is None:
            return []
        shortfall = self._room_needed(head)
        if shortfall is None:
            return []
        candidates = []
        for v in reversed(self._running):
            if v.priority <= head.priority:
                break
            if v.planned_samples < v.max_new_tokens:
                candidates.append(v)
        return self._make_room(candidates, shortfall)

    def _preempt_for_fairness(self) -> list[int]:
        """The admissible request of the least-served tenant, short of blocks or of a running
        slot, retracts running requests of tenants served more than its own by more than the
        quantum: the most served first (the latest admitted on equal counts), as many as make
        room; none if all of them would not. Admission then tries the head first."""
        head = next(iter(self._admission_candidates()), None)
        if head is None:
            return []
        least = self._served[head.tenant]
        candidates = [
            v
            for v in reversed(self._running)  # latest admitted first
            if self._served[v.tenant] - least > self.fairness_quantum
            and v.planned_samples < v.max_new_tokens
        ]
        if not candidates:
            return []
        shortfall = self._room_needed(head)
        if shortfall is None:
            return []
        candidates.sort(key=lambda v: -self._served[v.tenant])  # stable
        victims = self._make_room(candidates, shortfall)
        self.fairness_retractions += len(victims)
        if victims:
            self._fair_head = head
        return victims

    def _admission_candidates(self) -> Iterable[_Request]:
        """Policy order; with tenant fairness, again after each admission: the first admissible
        request of the least-served tenant among the first 256 waiting, after the request a
        fairness retraction made room for in this plan (the plan's decodes may have left another
        tenant the least served by now)."""
        if not self.tenant_fairness:
            yield from self._admission_order()
            return
        head, self._fair_head = self._fair_head, None
        if head is not None:
            yield head
        while True:
            window = [
                r
                for r in list(self._waiting)[:256]
                if not r.inflight and len(r.output) < r.max_new_tokens
            ]
            if not window:
                return
            yield min(window, key=lambda r: self._served[r.tenant])  # ties: queue order

    def _admission_order(self) -> list[_Request]:
        order = list(self._waiting)
        if self.policy == "lpm" and self.enable_radix_cache:
            hits = {r.rid: self._peek(r.tokens[:-1])[0] if r.match_prefix else 0 for r in order}
            order.sort(key=lambda r: -hits[r.rid])  # stable: ties keep queue order
        return order

    def _peek(self, tokens: list[int]) -> tuple[int, int]:
        """(cached prefix length, blocks of it in unlocked nodes), changing nothing."""
        if not self.enable_radix_cache:
            return 0, 0
        bs, node, pos, unlocked, key = self.block_size, self.cache._root, 0, 0, tuple(tokens)
        while pos + bs <= len(key):
            child = node.children.get(key[pos : pos + bs])
            if child is None:
                break
            n = 0
            while n < len(child.blocks) and pos + (n + 1) * bs <= len(key):
                if child.key[n * bs : (n + 1) * bs] != key[pos + n * bs : pos + (n + 1) * bs]:
                    break
                n += 1
            pos += n * bs
            unlocked += n if child.lock_ref == 0 else 0
            if n < len(child.blocks):
                break
            node = child
        return pos, unlocked

    def _schedule(
        self, req: _Request, n: int, decode: bool, old_len: int, drafts: Sequence[int] = ()
    ) -> tuple:
        start = req.num_scheduled
        sample = decode or start + n == req.prefill_target
        req.num_scheduled += n
        if self.tenant_fairness and start + n > req.served_to:  # a recompute is not served
            self._served[req.tenant] += start + n - max(start, req.served_to)
            req.served_to = start + n
        req.planned_samples += sample + len(drafts)  # a verify entry may yield 1 + k tokens
        req.inflight += 1
        return (req, start, n, decode, old_len, list(drafts))

    def _retract(self, req: _Request, memory_short: bool) -> None:
        self._release(req)
        self._running.remove(req)
        req.state = "retracted"
        # ahead of every waiting request of its priority or a larger value
        at = 0
        while at < len(self._waiting) and self._waiting[at].priority < req.priority:
            at += 1
        self._waiting.insert(at, req)
        self.retractions += 1
        if memory_short:
            self.reserve_ratio = self.init_reserve_ratio

    def _emit(self, entries: list, retracted: list[int]) -> Step:
        step_id = self._next_step
        self._next_step += 1
        rids, starts, counts = array("q"), array("i"), array("i")
        decode, sample = bytearray(), bytearray()
        tokens, offsets, nblocks, blocks = array("i"), array("i"), array("i"), array("i")
        prefill_tokens = decode_tokens = 0
        members = []
        for req, start, n, is_decode, old_len, drafts in entries:
            samples = is_decode or start + n == req.prefill_target
            rids.append(req.rid)
            starts.append(start)
            counts.append(n)
            decode.append(is_decode)
            sample.append(samples)
            offsets.append(old_len)
            nblocks.append(len(req.table) - old_len)
            blocks.extend(req.table[old_len:])
            if is_decode:
                tokens.extend(drafts)
                decode_tokens += n
            else:
                tokens.extend(req.tokens[start : start + n])
                prefill_tokens += n
            members.append((req, start + n, samples, len(drafts)))
        self._inflight.append((step_id, members))
        dropped, self._dropped = self._dropped, []
        return Step(
            step_id=step_id,
            rids=rids.tobytes(),
            start_pos=starts.tobytes(),
            num_tokens=counts.tobytes(),
            is_decode=bytes(decode),
            sample=bytes(sample),
            input_ids=tokens.tobytes(),
            block_offsets=offsets.tobytes(),
            block_counts=nblocks.tobytes(),
            block_ids=blocks.tobytes(),
            dropped=array("q", dropped).tobytes(),
            retracted=array("q", retracted).tobytes(),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
        )

    # -- completions --------------------------------------------------------------------------

    def report(self, step_id: int, rids: Sequence[int] | bytes, tokens: Sequence[int] | bytes):
        if not self._inflight or self._inflight[0][0] != step_id:
            expected = self._inflight[0][0] if self._inflight else None
            raise RuntimeError(f"report for step {step_id}, but the oldest is {expected}")
        rid_list, token_list = _ints(rids, "q"), _ints(tokens, "i")
        if len(rid_list) != len(token_list):
            raise ValueError(f"{len(rid_list)} rids but {len(token_list)} tokens")
        self._check_tokens(token_list)
        _, members = self._inflight[0]
        # rid -> [entry index, tokens named]; a verify entry of k drafts takes 1..k+1 tokens
        sampling = {req.rid: [i, 0] for i, (req, _, samples, _) in enumerate(members) if samples}
        targets = []
        for rid in rid_list:
            slot = sampling.get(rid)
            if slot is None or slot[1] > members[slot[0]][3]:
                raise RuntimeError(f"step {step_id}: request {rid} did not sample (or too often)")
            slot[1] += 1
            targets.append(slot[0])
        for i, named in sampling.values():  # only ended requests (the worker drops them) may
            req = members[i][0]  # be missing
            if named == 0 and req.state != "done":
                raise RuntimeError(f"step {step_id}: the sample of request {req.rid} is missing")
        seen = [0] * len(members)
        for i, token in zip(targets, token_list, strict=True):
            req, drafts = members[i][0], members[i][3]
            m, seen[i] = seen[i], seen[i] + 1
            last = m + 1 == sampling[req.rid][1]
            if drafts and req.state != "done" and not last and token != req.verifying[m]:
                raise RuntimeError(f"step {step_id}: request {req.rid}'s token {m} is no draft")
        self._inflight.popleft()
        for req, end, _, drafts in members:
            req.inflight -= 1
            if drafts:
                req.verifying = []
                if sampling[req.rid][1]:
                    self._count_verified(req, drafts, sampling[req.rid][1] - 1)
            if req.state != "running":
                continue
            if not drafts:
                req.num_computed = max(req.num_computed, end)
                continue
            # past the accepted drafts and one more position, the K/V is of rejected drafts
            accepted = sampling[req.rid][1]
            new_end = end - drafts - 1 + accepted
            req.num_computed = max(req.num_computed, new_end)
            req.planned_samples -= drafts + 1 - accepted
            keep = self._blocks_for(new_end)
            self.allocator.decref(req.table[keep:])
            req.table, req.num_scheduled = req.table[:keep], new_end
        for i, token in zip(targets, token_list, strict=True):
            req = members[i][0]
            if req.state != "done":
                req.output.append(token)
        loads = self._step_loads.pop(step_id, [])
        self._step_load_blocks.pop(step_id, None)
        failed, self._failed_loads = set(self._failed_loads), []
        for req, _, _, _ in members:
            if req.state == "running" and self.enable_radix_cache and req.match_prefix:
                self._cache_computed(req)
        self._finish_loads(loads, failed)
        for req in [m[0] for m in members] + loads:
            if req.state == "done" and req.inflight == 0:
                self._requests.pop(req.rid, None)

    def _count_verified(self, req: _Request, drafts: int, accepted: int) -> None:
        self.spec_verify_entries += 1
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += accepted
        self.spec_accepted_histogram[accepted] += 1
        req.spec_drafted += drafts
        req.spec_accepted += accepted

    def _cache_computed(self, req: _Request) -> None:
        """Offers the request's whole computed blocks to the cache and moves its lock down to
        them, so that they are not counted as evictable while it runs."""
        full = req.num_computed - req.num_computed % self.block_size
        if full <= req.tree_len:
            return
        tokens = req.tokens[:full]
        self.cache.insert(tokens, req.table[: full // self.block_size])
        _, _, handle = self.cache.match_prefix(tokens)
        self.cache.lock(handle)
        self.cache.unlock(req.handle)
        req.handle, req.tree_len = handle, full

    # -- inspection ---------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    def stats(self) -> dict:
        return dict(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_free_blocks=self.num_free_blocks,
            num_inflight_steps=self.num_inflight_steps,
            num_requests=len(self._requests),
            retractions=self.retractions,
            fairness_retractions=self.fairness_retractions,
            steps_planned=self._next_step,
            tenant_tokens=dict(sorted(self._served.items())),
            reserve_ratio=self.reserve_ratio,
            spec_verify_entries=self.spec_verify_entries,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_histogram=list(self.spec_accepted_histogram),
            ngram_corpus_tokens=0,  # the reference drafts nothing by itself
            spec_chained_entries=0,  # nor chains (speculative_chain needs its own drafts)
            spec_chained_fallbacks=0,
            disk_loaded_blocks=self.disk_loaded_blocks,
            disk_failed_blocks=self.disk_failed_blocks,
            num_loading=sum(1 for r in self._waiting if r.loading),
            **self.cache.stats(),
        )

    def request(self, rid: int) -> dict:
        req = self._requests.get(rid)
        if req is None:
            raise KeyError(f"unknown request {rid}")
        return dict(
            state=req.state,
            prompt_len=len(req.prompt),
            output_len=len(req.output),
            output=list(req.output),
            num_computed=req.num_computed,
            num_scheduled=req.num_scheduled,
            cached_tokens=req.cached_tokens,
            max_new_tokens=req.max_new_tokens,
            priority=req.priority,
            tenant=req.tenant,
            planned_samples=req.planned_samples,
            num_blocks=len(req.table),
            inflight_steps=req.inflight,
            draft_len=len(req.draft),
            verifying=len(req.verifying),
            spec_drafted=req.spec_drafted,
            spec_accepted=req.spec_accepted,
        )

    def block_states(self) -> bytes:
        cached = self.cache.cached_block_ids()
        return bytes(
            CACHED if b in cached else OWNED if self.allocator.refcount(b) else FREE
            for b in range(self.allocator.num_blocks)
        )

    def refcounts(self) -> bytes:
        counts = [self.allocator.refcount(b) for b in range(self.allocator.num_blocks)]
        return array("i", counts).tobytes()

    def check_invariants(self) -> None:
        if self.fairness_retractions > self.retractions:
            raise RuntimeError("fairness retractions are not a part of the retractions")
        for queue in (list(self._waiting), self._running):
            if [r.priority for r in queue] != sorted(r.priority for r in queue):
                raise RuntimeError("a queue is not ordered by priority")
        holders = [0] * self.allocator.num_blocks
        for b in self.cache.cached_block_ids():
            holders[b] += 1
        for req in self._running:
            for b in req.table:
                holders[b] += 1
        for req in self._waiting:
            for b in req.loading:
                holders[b] += 1
            if req.loading and not req.inflight:
                raise RuntimeError(f"request {req.rid}: loads that no step carries")
        for b, n in enumerate(holders):
            if self.allocator.refcount(b) != n:
                raise RuntimeError(f"block {b}: refcount {self.allocator.refcount(b)}, {n} holders")
        verify = {}
        for _, members in self._inflight:
            for req, end, _, drafts in members:
                if drafts:
                    if req.rid in verify:
                        raise RuntimeError(f"request {req.rid}: two unreported verify entries")
                    verify[req.rid] = (end, drafts)
        for req in self._requests.values():
            end, drafts = verify.get(req.rid, (0, 0))
            if len(req.verifying) != drafts:
                raise RuntimeError(f"request {req.rid}: verifying disagrees with its steps")
            if req.state == "running":
                if len(req.table) != self._blocks_for(req.num_scheduled):
                    raise RuntimeError(f"request {req.rid}: table not sized to its positions")
                if drafts and end != req.num_scheduled:
                    raise RuntimeError(f"request {req.rid}: scheduled past its verify entry")
            if req.draft and (req.state != "running" or req.verifying):
                raise RuntimeError(f"request {req.rid}: drafts while not decoding")
            if self.tenant_fairness and req.served_to < req.num_scheduled:
                raise RuntimeError(
                    f"request {req.rid}: planned positions its tenant was not served"
                )
            if req.planned_samples + (1 + len(req.draft) if req.draft else 0) > req.max_new_tokens:
                raise RuntimeError(f"request {req.rid}: samples could pass max_new_tokens")

    def _check_tokens(self, tokens: list[int]) -> None:
        for t in tokens:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t} out of range [0, {self.vocab_size})")
