"""Command line: ``python -m evals signoff --matrix FILE [...]`` (see docs/evals.md)."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from dpep_parity.progname import prog
    parser = argparse.ArgumentParser(prog=prog("python -m evals", dispatcher=True),
                                     description="Accuracy-parity sign-off")
    sub = parser.add_subparsers(dest="command", required=True)
    from dpep_parity.evals.signoff import add_arguments, run

    add_arguments(sub.add_parser("signoff", help="run the matrix, gate it, write the report"))
    args = parser.parse_args(argv)
    if args.command == "signoff":
        return run(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
