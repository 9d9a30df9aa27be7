"""``python -m ftrun.cli.completions``: print one completion script, or write all of them
(``--write completions/``, how the committed scripts are regenerated).

The entry point joins the two sides: the generator (this package) and the CLI it reads
(:mod:`ftrun.cli.main`, whose ``completions`` command imports the generator).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ftrun.cli.completions import FILENAMES, SHELLS, build_model, generate, write


def main(argv: Sequence[str] | None = None) -> int:
    from ftrun.cli.main import app

    parser = argparse.ArgumentParser(
        prog="python -m ftrun.cli.completions",
        description="Print ftrun's completion script for SHELL, or write all of them.",
    )
    parser.add_argument("shell", nargs="?", choices=SHELLS, help="print this shell's script")
    parser.add_argument("--write", metavar="DIR",
                        help=f"write {', '.join(FILENAMES.values())} into DIR")
    args = parser.parse_args(argv)
    if args.write is None and args.shell is None:
        parser.error("give SHELL or --write DIR")
    if args.write is not None:
        for path in write(args.write, app):
            print(f"wrote {path}")
    if args.shell is not None:
        sys.stdout.write(generate(args.shell, lambda: build_model(app)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
