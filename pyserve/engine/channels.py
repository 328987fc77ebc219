"""The ZMQ ring's endpoints: ipc:// sockets in a private temporary directory.

Every PULL end binds and every PUSH end connects, so each process owns the socket file it
reads from. The directory is created with mode 0700 (``tempfile.mkdtemp``), so no other user
can connect to the ring. Once all three connections stand, the engine removes the directory:
connected Unix sockets do not need their files, and nothing is left behind even if the main
process is killed later without a chance to clean up. If it is killed before (while the model
loads), the detokenizer, which outlives it by up to half a second, removes the directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class RingAddresses:
    directory: str
    worker_in: str  # main PUSH → worker PULL (bound by the worker)
    detok_in: str  # worker PUSH → detokenizer PULL (bound by the detokenizer)
    main_in: str  # detokenizer PUSH → main PULL (bound by main)

    @classmethod
    def create(cls) -> RingAddresses:
        directory = tempfile.mkdtemp(prefix="pyserve-")
        os.chmod(directory, 0o700)  # mkdtemp does this already; say it where it matters
        return cls(
            directory=directory,
            worker_in=f"ipc://{directory}/worker",
            detok_in=f"ipc://{directory}/detok",
            main_in=f"ipc://{directory}/main",
        )

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (torch.distributed's store, a replica's server)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main_sockets(
    ctx: zmq.Context, addresses: RingAddresses
) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
    """Main's two ends: a PUSH to the worker and a PULL from the detokenizer, plus a monitor
    that reports when the PUSH has connected (the one connection whose file main needs)."""
    to_worker = ctx.socket(zmq.PUSH)
    to_worker.setsockopt(zmq.LINGER, 0)
    to_worker.setsockopt(zmq.SNDHWM, 0)  # a burst of new requests must never block the loop
    monitor = to_worker.get_monitor_socket(zmq.EVENT_CONNECTED)
    to_worker.connect(addresses.worker_in)
    from_detok = ctx.socket(zmq.PULL)
    from_detok.setsockopt(zmq.LINGER, 0)
    from_detok.bind(addresses.main_in)
    return to_worker, from_detok, monitor
