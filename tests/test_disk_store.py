"""The disk tier's block files: what verifies loads, anything else (torn, truncated, foreign,
another key's or tokens') loads as None, never as wrong bytes; the directory is private and one
server at a time holds it."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from pyserve.worker.disk_store import DiskBlockStore, fingerprint_of, open_tier

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
    caplog.set_level(logging.WARNING, logger="pyserve.worker.disk_store")
    assert open_tier(tmp_path, FP) is None  # the fixture's store holds the lock
    assert any("held by another server" in r.getMessage() for r in caplog.records)
    store.close()
    again = open_tier(tmp_path, FP)
    assert again is not None
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
