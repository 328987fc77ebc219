"""Fixtures for the tests of ``pyserve._kernels``: each test runs on every instruction set this
CPU can run (``isa``) and with 1 and 2 threads in the kernels' pool (``threads``); both put the
module back as they found it. A module that starts a server (its own `server` fixture) gets the
openai SDK on it as `client`, and a module whose server holds its worker's steps
(``http_testlib.held_tiny_server``) the file that holds them as `hold`.

Triton kernels run in Triton's interpreter here (no GPU): the variable must be set before
anything imports triton, and it reaches the servers and workers the tests start too.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import atexit
import shutil
import tempfile

import pytest

# The servers and engines the tests start keep their disk cache here, never in the user's
# cache directory (http_testlib.Server gives each of its servers a directory of its own).
if "PYSERVE_STATE_DIR" not in os.environ:
    os.environ["PYSERVE_STATE_DIR"] = tempfile.mkdtemp(prefix="pyserve-test-state-")
    atexit.register(shutil.rmtree, os.environ["PYSERVE_STATE_DIR"], True)

from pyserve.worker import quant

KERNELS = quant.kernels()


@pytest.fixture(params=KERNELS.supported_isas())
def isa(request):
    before = KERNELS.isa()
    KERNELS.set_isa(request.param)
    yield request.param
    KERNELS.set_isa(before)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = KERNELS.num_threads()
    KERNELS.set_num_threads(request.param)
    yield request.param
    KERNELS.set_num_threads(before)


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK on the module's ``server`` (a module speaking another API defines its own)."""
    from http_testlib import openai_client

    with openai_client(server) as client:
        yield client


@pytest.fixture(scope="module")
def hold(tmp_path_factory):
    """While this file exists, a held server's worker holds each step before running it."""
    return tmp_path_factory.mktemp("hold") / "hold-steps"


@pytest.fixture
def held_writer(store, monkeypatch):
    """The disk tier's writer (the module's ``store``) blocked before each file until the
    Event is set."""
    import threading

    release = threading.Event()
    write = store._write

    def held(*args):
        release.wait(timeout=30)
        write(*args)

    monkeypatch.setattr(store, "_write", held)
    yield release
    release.set()
