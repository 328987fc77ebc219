"""Stored responses (``store: true``): what ``previous_response_id`` continues and
``GET /v1/responses/{id}`` returns, kept in a SQLite file so that a restarted server continues
a conversation.

One record a response: the response object, the request's own input items, and the
conversation before them (so a continuation needs no ancestor: an evicted parent does not break
its children). The file is bounded (``max_bytes`` of records, oldest evicted first) and
private (its directory 0700, the file 0600). With an API key, each record carries a hash of
the key that made it and only that key sees it.

Every SQLite call runs on one thread of its own, so the event loop never waits on the disk
and calls are serialized. ``put`` returns at once: the record is visible to ``get`` from that
moment (a client that continues a response right after its last event must find it), and is
written behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

log = logging.getLogger("pyserve.http")

T = TypeVar("T")

FILE_NAME = "responses.sqlite3"


def owner_of(api_key: str | None) -> str:
    """What a record remembers of the key that made it (never the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


@dataclass
class Record:
    response: dict  # the response object, as GET returns it
    input: list[dict]  # this request's input items (normal form)
    history: list[dict]  # the conversation before them: earlier inputs and outputs
    instructions: str | None = None

    def conversation(self) -> list[dict]:
        """What a response continuing this one carries on from."""
        return [*self.history, *self.input, *self.response.get("output", [])]


class ResponseStore:
    """Records by response id; ``max_bytes`` 0 keeps nothing. ``directory`` None: in memory
    only (an app embedded without a state directory)."""

    def __init__(self, directory: str | Path | None, max_bytes: int) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pyserve-responses")
        self._db: sqlite3.Connection | None = None
        self._total = 0
        self._pending: dict[str, tuple[str, bytes]] = {}  # id -> (owner, record): not yet written
        self._writes: set[asyncio.Future] = set()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    # ------------------------------------------------------------------ the loop's side

    def put(self, id: str, owner: str, record: Record) -> None:
        """Stores ``record`` (visible at once; written on the store's thread)."""
        if not self.enabled:
            return
        blob = msgspec.json.encode(record)
        if len(blob) > self.max_bytes:
            log.warning("response %s is larger than the store (%d bytes): not kept", id, len(blob))
            return
        self._pending[id] = (owner, blob)
        future = asyncio.get_running_loop().run_in_executor(
            self._pool, self._write, id, owner, blob
        )
        self._writes.add(future)
        future.add_done_callback(lambda f: self._written(id, blob, f))

    def _written(self, id: str, blob: bytes, future: asyncio.Future) -> None:
        self._writes.discard(future)
        if self._pending.get(id, (None, None))[1] is blob:
            del self._pending[id]
        if not future.cancelled() and future.exception() is not None:
            log.error("cannot store response %s: %s", id, future.exception())

    async def get(self, id: str, owner: str) -> Record | None:
        """The record of ``id`` if ``owner`` made it; None when unknown, evicted or not its."""
        if not self.enabled:
            return None
        pending = self._pending.get(id)
        if pending is not None:
            found_owner, blob = pending
        else:
            row = await self._call(self._read, id)
            if row is None:
                return None
            found_owner, blob = row
        if found_owner != owner:
            return None
        return msgspec.json.decode(blob, type=Record)

    async def delete(self, id: str, owner: str) -> bool:
        if await self.get(id, owner) is None:
            return False
        self._pending.pop(id, None)
        await self._call(self._delete, id)
        return True

    async def close(self) -> None:
        """Waits for the writes behind, then closes the file."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        with contextlib.suppress(RuntimeError):
            await self._call(self._close)
        self._pool.shutdown(wait=False)

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ the store's thread

    def _connection(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        if self.directory is None:
            path = ":memory:"
        else:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)  # an existing directory is made private too
            file = self.directory / FILE_NAME
            os.close(os.open(file, os.O_CREAT | os.O_RDWR, 0o600))
            os.chmod(file, 0o600)
            path = str(file)
        db = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
        db.execute(
            "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
            "created REAL NOT NULL, size INTEGER NOT NULL, record BLOB NOT NULL)"
        )
        db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")
        self._total = db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        self._db = db
        return db

    def _write(self, id: str, owner: str, blob: bytes) -> None:
        db = self._connection()
        total = self._total
        db.execute("BEGIN IMMEDIATE")
        try:
            old = db.execute("SELECT size FROM responses WHERE id = ?", (id,)).fetchone()
            db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (id, owner, time.time(), len(blob), blob),
            )
            self._total += len(blob) - (old[0] if old else 0)
            self._evict(db)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            self._total = total
            raise

    def _evict(self, db: sqlite3.Connection) -> None:
        """Deletes the oldest records until the rest fit in ``max_bytes``."""
        while self._total > self.max_bytes:
            rows = db.execute(
                "SELECT id, size FROM responses ORDER BY created, rowid LIMIT 64"
            ).fetchall()
            if not rows:
                self._total = 0
                return
            for id, size in rows:
                db.execute("DELETE FROM responses WHERE id = ?", (id,))
                self._total -= size
                if self._total <= self.max_bytes:
                    return

    def _read(self, id: str) -> tuple[str, bytes] | None:
        row = (
            self._connection()
            .execute("SELECT owner, record FROM responses WHERE id = ?", (id,))
            .fetchone()
        )
        return (row[0], bytes(row[1])) if row is not None else None

    def _delete(self, id: str) -> None:
        db = self._connection()
        row = db.execute("SELECT size FROM responses WHERE id = ?", (id,)).fetchone()
        if row is not None:
            db.execute("DELETE FROM responses WHERE id = ?", (id,))
            self._total -= row[0]

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
