"""The ``pyserve`` command (also ``python -m pyserve``)."""

from __future__ import annotations

import sys

from pyserve import early_worker


def main(argv: list[str] | None = None) -> int:
    """Starts the worker's process if the command will need one, then runs the CLI (whose imports
    take as long as the worker's first ones: they overlap)."""
    args = sys.argv[1:] if argv is None else list(argv)
    early_worker.start(args)
    from pyserve.cli import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
