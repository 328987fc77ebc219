"""``python -m pyserve.worker --config '<json WorkerConfig>'``, or ``--config -``: import what
loading needs first, then read the config as one line on stdin (pyserve/early_worker.py)."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from pyserve.worker.process import WorkerConfig, preload, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m pyserve.worker")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON; -: on stdin")
    args = parser.parse_args()
    if args.config != "-":
        return run(msgspec.json.decode(args.config, type=WorkerConfig))
    from pyserve.lifecycle import die_with_parent

    die_with_parent(os.getppid())
    preload()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0  # main exited, or went on without this worker
    return run(msgspec.json.decode(line, type=WorkerConfig))


if __name__ == "__main__":
    sys.exit(main())
