"""The disk tier's block files: one KV block per file, named by the radix cache's 64-bit key.

A file is ``<key as 16 hex digits>.kv``: a fixed header (magic, the KV-layout fingerprint, the
key, the parent block's key, the token count, the payload size), the block's token ids, the
payload (the block's K/V bytes, all layers) and a BLAKE2b digest of everything before it. A file
is written to a temporary name and renamed, so a reader sees a whole file or none; a torn write,
a truncated file, a full disk or a foreign fingerprint all fail the checks, and ``load`` answers
None: the caller recomputes, it never uses bytes that did not verify.

Writes run on one background thread (off the step loop): ``save`` copies nothing and returns at
once; ``wait`` blocks until every queued write is on disk (tests, shutdown). A block saved but
not yet written loads from memory (the step after its save may need it back), and drops go
through the same queue as writes, so that save, drop, save again of one key end as the last save.
A queued write whose key was dropped or saved again since is skipped.

``open_tier`` makes ``<base>/kv-<fingerprint>/`` private (mode 0700) and holds an exclusive
``fcntl`` lock on its ``lock`` file for the store's lifetime: a second server on the same
directory takes a sibling directory of its own instead of sharing files with the first.
``open_store`` takes one given directory alike (a tensor-parallel rank's: disk_ranks.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import queue
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s32sQQIQ")  # magic, fingerprint, key, parent key, tokens, payload
_DIGEST_BYTES = 32


@dataclass(frozen=True)
class BlockHeader:
    key: int
    parent_key: int
    tokens: tuple[int, ...]
    payload_bytes: int


@dataclass(frozen=True, eq=False)  # compared by identity: "is it still the pending write"
class _Save:
    key: int
    parent_key: int
    tokens: tuple[int, ...]
    payload: bytes


@dataclass(frozen=True)
class _Drop:
    key: int


def fingerprint_of(*parts: object) -> bytes:
    """32 bytes naming everything that determines a block's KV bytes (model, dtype, layout...)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


class DiskBlockStore:
    """Block files in one private directory, for one KV-layout fingerprint."""

    def __init__(self, directory: Path, fingerprint: bytes, lock_file: object = None) -> None:
        if len(fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(fingerprint)}")
        self.directory = directory
        self.fingerprint = fingerprint
        self._lock_file = lock_file  # kept open: closing it would release the lock
        self._queue: queue.Queue[_Save | _Drop | None] = queue.Queue()
        # key -> its latest queued save, until the writer has written it: loads read it here
        self._pending: dict[int, _Save] = {}
        # key -> its queued drops not yet done: its file, if any, is gone as far as loads go
        self._dropping: dict[int, int] = {}
        self._pending_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, key: int) -> Path:
        return self.directory / f"{key:016x}.kv"

    # -- writes (background) ----------------------------------------------------------------

    def save(self, key: int, parent_key: int, tokens: list[int], payload: bytes) -> None:
        """Queues a block file; payload must not change afterwards (pass a fresh bytes)."""
        item = _Save(key, parent_key, tuple(tokens), payload)
        with self._pending_lock:
            self._pending[key] = item
        self._queue.put(item)

    @property
    def pending(self) -> int:
        """Saves queued and not yet written."""
        with self._pending_lock:
            return len(self._pending)

    def wait(self) -> None:
        """Until every queued write is done (or failed: a failed write leaves no file)."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if isinstance(item, _Drop):
                    with contextlib.suppress(FileNotFoundError):
                        self.path(item.key).unlink()
                elif self._is_pending(item):  # else dropped or saved again since: skipped
                    self._write(item.key, item.parent_key, item.tokens, item.payload)
            except OSError as e:  # a full disk costs a recompute later, nothing else
                logger.warning("disk KV tier: could not write block %016x: %s", item.key, e)
            finally:
                if isinstance(item, _Save):
                    with self._pending_lock:
                        if self._pending.get(item.key) is item:
                            del self._pending[item.key]
                elif isinstance(item, _Drop):
                    self._dropped(item.key)
                self._queue.task_done()

    def _dropped(self, key: int) -> None:
        with self._pending_lock:
            left = self._dropping.pop(key) - 1
            if left:
                self._dropping[key] = left

    def _is_pending(self, item: _Save) -> bool:
        with self._pending_lock:
            return self._pending.get(item.key) is item

    def _write(self, key: int, parent_key: int, tokens: tuple, payload: bytes) -> None:
        head = _HEADER.pack(MAGIC, self.fingerprint, key, parent_key, len(tokens), len(payload))
        body = head + struct.pack(f"<{len(tokens)}i", *tokens) + payload
        final = self.path(key)
        tmp = final.with_suffix(f".tmp{threading.get_ident()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.write(_digest(body))
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    # -- reads --------------------------------------------------------------------------------

    def read_header(self, path: Path) -> BlockHeader | None:
        """The header of a block file (a small read), or None if it is not one of ours."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return None
                magic, fp, key, parent, n, payload = _HEADER.unpack(head)
                if magic != MAGIC or fp != self.fingerprint or path.name != f"{key:016x}.kv":
                    return None
                raw = f.read(4 * n)
        except OSError:
            return None
        if len(raw) != 4 * n:
            return None
        return BlockHeader(key, parent, struct.unpack(f"<{n}i", raw), payload)

    def index(self) -> list[BlockHeader]:
        """Every block file's header (unverified payloads: load checks them)."""
        headers = (self.read_header(p) for p in sorted(self.directory.glob("*.kv")))
        return [h for h in headers if h is not None]

    def load(self, key: int, tokens: list[int] | None = None) -> bytes | None:
        """The block's payload if its file is whole, ours and (given tokens) for these tokens;
        a save still queued answers from memory."""
        with self._pending_lock:
            item = self._pending.get(key)
            if item is None and key in self._dropping:
                return None
        if item is not None:
            if tokens is not None and list(item.tokens) != list(tokens):
                return None
            return item.payload
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        if len(data) < _HEADER.size + _DIGEST_BYTES:
            return None
        body = memoryview(data)[:-_DIGEST_BYTES]
        if _digest(body) != data[-_DIGEST_BYTES:]:
            return None
        magic, fp, file_key, _, n, payload = _HEADER.unpack_from(data)
        start = _HEADER.size + 4 * n
        if magic != MAGIC or fp != self.fingerprint or file_key != key:
            return None
        if start + payload != len(body):
            return None
        if tokens is not None and list(struct.unpack_from(f"<{n}i", data, _HEADER.size)) != list(
            tokens
        ):
            return None
        return bytes(body[start:])

    # -- removal ------------------------------------------------------------------------------

    def drop(self, key: int) -> None:
        """Removes the block: at once for loads, its file in order with the queued writes."""
        with self._pending_lock:
            self._pending.pop(key, None)
            self._dropping[key] = self._dropping.get(key, 0) + 1
        self._queue.put(_Drop(key))

    def clear(self) -> None:
        """Deletes every block file (the queued writes are skipped, the one under way waited
        for: it would recreate its file)."""
        with self._pending_lock:
            self._pending.clear()
        self.wait()
        for p in self.directory.glob("*.kv"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join()
        if self._lock_file is not None:
            self._lock_file.close()


MAX_SHARERS = 8  # servers of one layout on one state directory, each with its own tier


def open_tier(base: Path, fingerprint: bytes) -> DiskBlockStore | None:
    """The store for this fingerprint under base: ``kv-<fingerprint>``, or while another server
    holds that, ``kv-<fingerprint>.1``, ``.2``... (replicas of one model each get a tier); None
    when MAX_SHARERS are held."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"kv-{fingerprint.hex()[:16]}"
    for n in range(MAX_SHARERS):
        store = open_store(base / (name if n == 0 else f"{name}.{n}"), fingerprint)
        if store is None:
            continue
        if n:
            logger.info(
                "disk KV tier: %s is held by another server; using %s", name, store.directory
            )
        return store
    logger.warning(
        "disk KV tier: %d servers hold %s under %s; running without it", MAX_SHARERS, name, base
    )
    return None


def open_store(directory: Path, fingerprint: bytes) -> DiskBlockStore | None:
    """The store in ``directory`` (made private), or None while another process holds it."""
    directory.mkdir(mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)  # an existing directory is made private too
    lock_file = open(directory / "lock", "a+b")  # noqa: SIM115 - held open for the lock
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        return None
    # a server that died mid-write left its temporary file; no writer is left to rename it
    for stale in directory.glob("*.tmp*"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    return DiskBlockStore(directory, fingerprint, lock_file)


# The packed index (WorkerReady.disk_index), read by main (torch-free) and written by the worker.


def index_dtype(block_size: int) -> np.dtype:
    """One record of the packed index (WorkerReady.disk_index)."""
    return np.dtype([("key", "<u8"), ("parent", "<u8"), ("tokens", "<i4", (block_size,))])


def pack_index(headers: Sequence[BlockHeader], block_size: int, block_bytes: int) -> bytes:
    """The headers of whole blocks of this layout, packed as WorkerReady.disk_index; a header
    of another token count or payload size (a file that could never load here) is left out."""
    whole = [h for h in headers if len(h.tokens) == block_size and h.payload_bytes == block_bytes]
    records = np.zeros(len(whole), dtype=index_dtype(block_size))
    for i, h in enumerate(whole):
        records[i] = (h.key, h.parent_key, h.tokens)
    return records.tobytes()


def unpack_index(packed: bytes, block_size: int) -> list[tuple[int, int, list[int]]]:
    """(key, parent key, tokens) of each record of a packed index."""
    records = np.frombuffer(packed, dtype=index_dtype(block_size))
    return [(int(r["key"]), int(r["parent"]), r["tokens"].tolist()) for r in records]
