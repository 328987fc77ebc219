"""``python -m pyserve.worker --config '<json WorkerConfig>'``"""

from __future__ import annotations

import argparse
import sys

import msgspec

from pyserve.worker.process import WorkerConfig, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m pyserve.worker")
    parser.add_argument("--config", required=True, help="WorkerConfig as JSON")
    args = parser.parse_args()
    return run(msgspec.json.decode(args.config, type=WorkerConfig))


if __name__ == "__main__":
    sys.exit(main())
