"""The disk tier's block files: what verifies loads, anything else (torn, truncated, foreign,
another key's or tokens') loads as None, never as wrong bytes; the directory is private and one
server at a time holds it."""

from __future__ import annotations

import logging
import os
import stat
import threading

import pytest

from pyserve.worker.disk_store import MAX_SHARERS, DiskBlockStore, fingerprint_of, open_tier

FP = fingerprint_of("tiny-model", "bf16", 16, (2, 4, 64))


@pytest.fixture
def store(tmp_path):
    s = open_tier(tmp_path, FP)
    assert s is not None
    yield s
    s.close()


def saved(store: DiskBlockStore, key: int = 0xABC, tokens=(1, 2, 3), payload=b"kv" * 100):
    store.save(key, 7, list(tokens), payload)
    store.wait()
    return store.path(key)


def test_a_saved_block_loads_back_and_is_indexed(store):
    saved(store, payload=b"\x00\x01" * 500)
    assert store.load(0xABC) == b"\x00\x01" * 500
    assert store.load(0xABC, [1, 2, 3]) == b"\x00\x01" * 500
    assert store.load(0xABC, [1, 2, 4]) is None  # another prefix's block: never used
    assert store.load(0xDEF) is None  # no file
    [header] = store.index()
    assert (header.key, header.parent_key, header.tokens, header.payload_bytes) == (
        0xABC,
        7,
        (1, 2, 3),
        1000,
    )
    assert not [p for p in store.directory.iterdir() if ".tmp" in p.name]  # renamed into place


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "append"])
def test_a_damaged_file_loads_as_none(store, damage):
    path = saved(store)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 5]
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    assert store.load(0xABC) is None


def test_another_fingerprint_is_ignored_never_misread(tmp_path, store):
    path = saved(store)
    other = DiskBlockStore(store.directory, fingerprint_of("another-model"))
    try:
        assert other.load(0xABC) is None
        assert other.index() == []
        assert other.read_header(path) is None
    finally:
        other.close()


def test_a_file_renamed_to_another_key_is_refused(store):
    path = saved(store)
    os.replace(path, store.path(0x123))
    assert store.load(0x123) is None
    assert store.index() == []


def test_the_directory_is_private_and_held_by_one_server(tmp_path, store, caplog):
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    caplog.set_level(logging.INFO, logger="pyserve.worker.disk_store")
    second = open_tier(tmp_path, FP)  # the fixture's store holds the first directory
    assert second is not None and second.directory != store.directory
    assert second.directory.name == store.directory.name + ".1"
    assert stat.S_IMODE(second.directory.stat().st_mode) == 0o700
    assert any("held by another server" in r.getMessage() for r in caplog.records)
    more = [open_tier(tmp_path, FP) for _ in range(MAX_SHARERS - 2)]
    assert all(s is not None for s in more)
    assert open_tier(tmp_path, FP) is None  # every sibling is held: none for a ninth server
    for s in [second, *more]:
        s.close()
    store.close()
    again = open_tier(tmp_path, FP)
    assert again is not None and again.directory == store.directory
    again.close()


def test_drop_and_clear_remove_files(store):
    saved(store, key=1)
    saved(store, key=2)
    store.drop(1)
    assert store.load(1) is None and store.load(2) is not None
    store.save(3, 0, [5], b"late")
    store.clear()  # waits for the queued write first
    assert store.index() == []


def test_a_failed_write_leaves_no_file(store, monkeypatch, caplog):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    caplog.set_level(logging.WARNING, logger="pyserve.worker.disk_store")
    monkeypatch.setattr("pyserve.worker.disk_store.os.replace", full_disk)
    saved(store)
    assert store.load(0xABC) is None
    assert list(store.directory.glob("*.kv*")) == []  # nor a temporary file
    assert any("could not write block" in r.getMessage() for r in caplog.records)


def test_a_queued_save_loads_before_its_file_exists(store, held_writer):
    store.save(0xABC, 7, [1, 2, 3], b"pending")
    assert not store.path(0xABC).exists()
    assert store.load(0xABC) == b"pending"
    assert store.load(0xABC, [1, 2, 3]) == b"pending"
    assert store.load(0xABC, [1, 2, 4]) is None  # the tokens are checked as for a file
    held_writer.set()
    store.wait()
    assert store.pending == 0
    assert store.load(0xABC) == b"pending"  # now from the file
    assert store.path(0xABC).exists()


def test_drops_apply_in_order_with_the_queued_writes(store, held_writer):
    store.save(1, 0, [5], b"first")
    store.drop(1)
    assert store.load(1) is None  # at once, though the write is still queued
    store.save(1, 0, [5], b"second")
    assert store.load(1) == b"second"
    store.save(2, 0, [6], b"kept")
    store.drop(2)
    held_writer.set()
    store.wait()
    assert store.load(1) == b"second"  # save, drop, save again: the last save stands
    assert store.load(2) is None and not store.path(2).exists()
    assert store.pending == 0


def test_a_dropped_file_no_longer_loads_before_the_writer_removes_it(store, held_writer):
    held_writer.set()
    path = saved(store, key=3)
    held_writer.clear()
    store.save(4, 0, [1], b"x")  # holds the writer: the drop below waits behind it
    store.drop(3)
    assert path.exists() and store.load(3) is None
    held_writer.set()
    store.wait()
    assert not path.exists()


def test_clear_skips_the_queued_writes(store, held_writer):
    for key in range(3):
        store.save(key, 0, [key], b"q")
    clearing = threading.Thread(target=store.clear)  # waits for the write under way
    clearing.start()
    held_writer.set()
    clearing.join(timeout=30)
    assert store.index() == [] and store.pending == 0
    assert all(store.load(key) is None for key in range(3))


def test_a_stale_temporary_file_is_removed_when_the_tier_opens(tmp_path):
    first = open_tier(tmp_path, FP)
    assert first is not None
    stale = first.directory / "0000000000000abc.tmp1234"
    stale.write_bytes(b"torn")
    first.close()
    second = open_tier(tmp_path, FP)
    assert second is not None
    try:
        assert not stale.exists()
    finally:
        second.close()
