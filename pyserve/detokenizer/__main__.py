"""``python -m pyserve.detokenizer --config '<json DetokenizerConfig>'``"""

from __future__ import annotations

import argparse

import msgspec

from pyserve.detokenizer.process import DetokenizerConfig, run


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pyserve.detokenizer")
    parser.add_argument("--config", required=True, help="DetokenizerConfig as JSON")
    args = parser.parse_args()
    run(msgspec.json.decode(args.config, type=DetokenizerConfig))


if __name__ == "__main__":
    main()
