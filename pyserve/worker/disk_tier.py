"""The disk tier's worker side: KV blocks moved between the worker's pools and a DiskBlockStore.

A block's payload is its bytes in every KV tensor the worker holds, in a fixed order: the model's
pool (per layer K, then V, then an int8 cache's scales; ``PagedKVCache.block_views``), then the
draft model's pool when one runs (it is indexed by the same block ids). Each tensor contributes
the block's slice with the block axis taken out, in C order.

The core plans the operations (``Step.clear_disk``, ``save_*``, ``load_*``, ``drop_keys``); the
worker does them before the step's forward pass, in that order. A save copies the blocks out
before it returns (the forward pass may then overwrite them) and leaves the file writing to the
store's thread; a load verifies every file before anything is written into the pool, and a block
that fails (missing, damaged, another layout's, the wrong size) is reported, never written: main
recomputes it. A disk error never fails the step.

``tier_fingerprint`` names everything that determines a block's bytes (the files the model was
loaded from, by size and modification time, the dtypes, the quantization, the backend, the pool's
shapes, the tensor-parallel rank and group size), so that a block file is only ever loaded into
the layout that wrote it. Under ``--tp`` each rank holds a tier of its own shard
(disk_ranks.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyserve.worker.disk_store import DiskBlockStore, fingerprint_of, pack_index

if TYPE_CHECKING:
    from pyserve.wire.main_to_worker import Step
    from pyserve.worker.kv_cache import PagedKVCache
    from pyserve.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)

# bumped whenever the payload's layout or the fingerprint's parts change
FORMAT_VERSION = "pyserve-kv-blocks-1"
# files of a model directory whose change may change its K/V (weights and configuration)
_MODEL_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".json")
# a save gathers at most this many bytes at once (a long eviction goes in pieces)
_SAVE_CHUNK_BYTES = 256 * 2**20


class DiskTier:
    """Moves whole blocks of ``caches`` (indexed by the same block ids) to and from ``store``."""

    def __init__(
        self,
        store: DiskBlockStore,
        caches: Sequence[PagedKVCache],
        *,
        num_blocks: int,
        block_size: int,
        load_threads: int = 4,
    ) -> None:
        """``num_blocks``: the block ids the core hands out (a pool may hold more, such as a
        backend's scratch block)."""
        self.store = store
        self.num_blocks = num_blocks
        self.block_size = block_size
        # (block-first view, a block's shape, its bytes) per tensor, in payload order
        self._tensors: list[tuple[torch.Tensor, tuple[int, ...], int]] = []
        for cache in caches:
            for tensor, dim in cache.block_views():
                view = tensor.movedim(dim, 0)
                shape = tuple(view.shape[1:])
                self._tensors.append((view, shape, view[0].numel() * view.element_size()))
        if not self._tensors:
            raise ValueError("a disk tier needs at least one KV tensor")
        self.device = self._tensors[0][0].device
        self.block_bytes = sum(nbytes for _, _, nbytes in self._tensors)
        # reads verify a digest per file: hashlib releases the GIL on large buffers
        self._readers = ThreadPoolExecutor(max(1, load_threads), thread_name_prefix="kv-disk-read")
        self._closed = False

    @property
    def directory(self) -> Path:
        return self.store.directory

    # -- the step's operations -------------------------------------------------------------------

    def apply(self, step: Step) -> list[int]:
        """Does the step's clear, saves, loads and drops, in that order; the load block ids that
        failed. Raises ValueError on malformed arrays, before anything is done. The clear goes
        first: the step's saves are of blocks evicted after the flush that asked for it."""
        ops = DiskOps.of(step, self.block_size)
        self._check_blocks(ops.save_blocks)
        self._check_loads(ops.load_blocks)
        if ops.clear:
            self.clear()
        self.save(ops.save_blocks, ops.save_keys, ops.save_parents, ops.save_tokens)
        failed = self.load(ops.load_blocks, ops.load_keys)
        self.drop(ops.drop_keys)
        return failed

    def save(
        self,
        blocks: Sequence[int],
        keys: Sequence[int],
        parents: Sequence[int],
        tokens: Sequence[Sequence[int]],
    ) -> None:
        """Copies the blocks out now and queues their files."""
        if not (len(blocks) == len(keys) == len(parents) == len(tokens)):
            raise ValueError(
                f"disk saves: {len(blocks)} blocks, {len(keys)} keys, {len(parents)} parents, "
                f"{len(tokens)} token rows"
            )
        self._check_blocks(blocks)
        chunk = max(1, _SAVE_CHUNK_BYTES // self.block_bytes)
        for lo in range(0, len(blocks), chunk):
            rows = self._gather(blocks[lo : lo + chunk])
            for i, row in enumerate(rows):
                j = lo + i
                self.store.save(keys[j], parents[j], list(tokens[j]), row.tobytes())

    def load(self, blocks: Sequence[int], keys: Sequence[int]) -> list[int]:
        """Fills the blocks from their files; the block ids that could not be (left as they
        were)."""
        if len(blocks) != len(keys):
            raise ValueError(f"disk loads: {len(blocks)} blocks, {len(keys)} keys")
        if not blocks:
            return []
        self._check_loads(blocks)
        if len(keys) == 1:
            payloads = [self._read(keys[0])]
        else:
            payloads = list(self._readers.map(self._read, keys))
        ok = [p is not None and len(p) == self.block_bytes for p in payloads]
        good = [i for i, whole in enumerate(ok) if whole]
        # main logs the failures (scheduler_loop.py) and recomputes those blocks
        failed = [int(b) for b, whole in zip(blocks, ok, strict=True) if not whole]
        if good:
            rows = np.empty((len(good), self.block_bytes), dtype=np.uint8)
            for row, i in enumerate(good):
                rows[row] = np.frombuffer(payloads[i], dtype=np.uint8)
            self._scatter([int(blocks[i]) for i in good], torch.from_numpy(rows))
        return failed

    def drop(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.store.drop(key)

    def clear(self) -> None:
        try:
            self.store.clear()
        except OSError as e:
            log.warning("disk KV tier: could not clear %s: %s", self.directory, e)

    def index(self) -> bytes:
        """The block files found now, packed as WorkerReady.disk_index."""
        return pack_index(self.store.index(), self.block_size, self.block_bytes)

    def listed_index(self) -> bytes | None:
        """``index()``, or None when the directory cannot be listed (logged: the files stay,
        and main starts with an empty disk tier)."""
        try:
            return self.index()
        except OSError as e:
            log.warning("disk KV tier: could not list %s: %s", self.directory, e)
            return None

    def close(self) -> None:
        """Waits for the queued writes, then lets the directory go."""
        if self._closed:
            return
        self._closed = True
        self._readers.shutdown()
        self.store.close()

    # -- moving bytes ----------------------------------------------------------------------------

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        # an index out of range would be a device-side assert on a GPU: refused here
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"disk ops: block ids {bad[:8]} outside the pool of {self.num_blocks}")

    def _check_loads(self, blocks: Sequence[int]) -> None:
        self._check_blocks(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"disk loads: a block loaded twice in one step: {list(blocks)}")

    def _gather(self, blocks: Sequence[int]) -> np.ndarray:
        """uint8 [len(blocks), block_bytes]: each block's payload, copied off the pool."""
        index = torch.as_tensor(list(blocks), dtype=torch.int64, device=self.device)
        parts = [
            view.index_select(0, index).reshape(len(blocks), -1).view(torch.uint8)
            for view, _, _ in self._tensors
        ]
        return torch.cat(parts, dim=1).cpu().numpy()  # .cpu() waits for a device's copy

    def _scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Writes each row of ``rows`` (uint8 [n, block_bytes]) into its block."""
        index = torch.as_tensor(blocks, dtype=torch.int64, device=self.device)
        rows = rows.to(self.device)
        offset = 0
        for view, shape, nbytes in self._tensors:
            part = rows[:, offset : offset + nbytes].contiguous().view(view.dtype)
            view.index_copy_(0, index, part.view(len(blocks), *shape))
            offset += nbytes

    def _read(self, key: int) -> bytes | None:
        try:
            return self.store.load(key)
        except OSError as e:  # the store answers None for a bad file; anything else costs a block
            log.warning("disk KV tier: could not read block %016x: %s", key, e)
            return None


class DiskOps:
    """A Step's disk operations, unpacked and checked."""

    def __init__(self) -> None:
        self.save_blocks: list[int] = []
        self.save_keys: list[int] = []
        self.save_parents: list[int] = []
        self.save_tokens: list[list[int]] = []
        self.load_blocks: list[int] = []
        self.load_keys: list[int] = []
        self.drop_keys: list[int] = []
        self.clear = False

    @classmethod
    def of(cls, step: Step, block_size: int) -> DiskOps:
        """Raises ValueError on arrays of the wrong length. A step without the saves' parents or
        tokens (a core that does not send them) saves parent 0 and no tokens: such a file still
        loads by its key, and the index at start leaves it out."""
        ops = cls()
        ops.save_blocks = _ints(step.save_blocks, "<i4", "save_blocks")
        n = len(ops.save_blocks)
        ops.save_keys = _ints(step.save_keys, "<u8", "save_keys")
        ops.save_parents = _ints(step.save_parents, "<u8", "save_parents") or [0] * n
        tokens = _ints(step.save_tokens, "<i4", "save_tokens")
        if tokens and len(tokens) != n * block_size:
            raise ValueError(f"save_tokens: {len(tokens)} ids for {n} blocks of {block_size}")
        ops.save_tokens = (
            [tokens[i * block_size : (i + 1) * block_size] for i in range(n)]
            if tokens
            else [[] for _ in range(n)]
        )
        if not (len(ops.save_keys) == len(ops.save_parents) == n):
            raise ValueError(
                f"disk saves: {n} blocks, {len(ops.save_keys)} keys, "
                f"{len(ops.save_parents)} parents"
            )
        ops.load_blocks = _ints(step.load_blocks, "<i4", "load_blocks")
        ops.load_keys = _ints(step.load_keys, "<u8", "load_keys")
        if len(ops.load_blocks) != len(ops.load_keys):
            raise ValueError(
                f"disk loads: {len(ops.load_blocks)} blocks, {len(ops.load_keys)} keys"
            )
        ops.drop_keys = _ints(step.drop_keys, "<u8", "drop_keys")
        ops.clear = bool(step.clear_disk)
        return ops


def _ints(packed: bytes, dtype: str, what: str) -> list[int]:
    size = np.dtype(dtype).itemsize
    if len(packed) % size:
        raise ValueError(f"{what}: {len(packed)} bytes, not a whole number of {dtype}")
    return np.frombuffer(packed, dtype=dtype).tolist()


# -- the fingerprint -------------------------------------------------------------------------------


def model_identity(model: str | None) -> tuple:
    """The model's files as loaded: its resolved path and each file's size and modification
    time (a changed file is another model, without hashing gigabytes)."""
    from pyserve.model_files import gguf_shards, resolve_model

    source = resolve_model(model)
    path = Path(source.path)
    if source.kind == "gguf":
        files = [Path(p) for p in gguf_shards(source.path)]
    else:
        files = sorted(p for p in path.iterdir() if p.suffix in _MODEL_FILE_SUFFIXES)
    return (str(path), tuple(_file_identity(p) for p in files if p.is_file()))


def _file_identity(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (path.name, st.st_size, st.st_mtime_ns)


def runner_identity(runner: ModelRunner) -> tuple:
    """What of one ModelRunner determines the K/V it writes, and their layout."""
    settings = runner.settings
    cache = runner.kv_cache
    shapes = tuple(
        (tuple(s for d, s in enumerate(tensor.shape) if d != dim), str(tensor.dtype))
        for tensor, dim in cache.block_views()
    )
    mmproj = None
    if settings.mmproj:  # an image's positions hold the projector's embeddings
        resolved = Path(settings.mmproj).expanduser().resolve()
        mmproj = (str(resolved), _file_identity(resolved))
    return (
        model_identity(settings.model),
        mmproj,
        str(runner.vision_dtype),
        runner.dtype_name,
        runner.kv_cache_dtype_name,
        settings.quantization,
        runner.quantization,
        settings.activation_bits,
        runner.block_size,
        runner.max_model_len,  # a served context length may pick another RoPE scaling
        len(cache.k),
        cache.num_kv_heads,
        cache.head_dim,
        runner.backend.info().name,
        runner.device.type,
        shapes,
    )


def tier_fingerprint(
    runner: ModelRunner,
    draft: ModelRunner | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> bytes:
    """The fingerprint of the blocks ``runner`` (and the draft model's runner) write; under
    ``--tp`` each rank's shard of a block is its own (disk_ranks.py)."""
    import pyserve

    return fingerprint_of(
        FORMAT_VERSION,
        pyserve.__version__,
        torch.__version__,
        runner_identity(runner),
        runner_identity(draft) if draft is not None else None,
        ("tensor parallel rank", tp_rank, "of", tp_size),
    )


def open_disk_tier(
    directory: str, runner: ModelRunner, draft: ModelRunner | None = None
) -> DiskTier | None:
    """The tier under ``directory`` for these runners, or None when another server holds it."""
    from pyserve.worker.disk_store import open_tier

    # absolute: WorkerReady tells main where the files are
    store = open_tier(Path(directory).expanduser().absolute(), tier_fingerprint(runner, draft))
    return tier_over(store, runner, draft) if store is not None else None


def tier_over(
    store: DiskBlockStore, runner: ModelRunner, draft: ModelRunner | None = None
) -> DiskTier:
    """The tier moving these runners' blocks to and from ``store``."""
    caches = [runner.kv_cache] + ([draft.kv_cache] if draft is not None else [])
    return DiskTier(store, caches, num_blocks=runner.num_blocks, block_size=runner.block_size)
