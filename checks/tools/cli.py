"""`dpep`: one command for the suite's tools. Each subcommand is the module's own command line, unchanged:
`dpep killtable --jobs 2` is `python -m checks.tools.killtable --jobs 2`, with the same options, help and exit code.

Only the standard library is imported here: `dpep --help` must answer at once, and a subcommand's module (torch,
transformers, lm-eval) is imported only to run it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from dpep_parity import (
    own_module,  # the import root only: no torch
    progname,
)

# name -> (module, arguments put before the user's, one line of help); the module's main(argv) returns the exit
# code (None counts as 0).
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "signoff": ("evals.__main__", ("signoff",), "accuracy-parity sign-off of a matrix of parallel configurations "
                                                "(python -m evals signoff; docs/evals.md)"),
    "killtable": ("checks.tools.killtable", (), "run the property suite on every mutant and a control; "
                                          "writes reports/kill-table.{md,json}"),
    "replay": ("checks.tools.replay", (), "replay one parity example exactly, from a failure's replay: line"),
    "invariance": ("checks.judge.invariance", (), "replay one invariance pair exactly, from a failure's replay: line, or "
                                            "print the drift table (docs/property-suite.md)"),
    "bisect": ("checks.tools.bisect", (), "find the SGLang release where a replay line's or a pytest run's verdict "
                                    "changes (docs/museum.md)"),
    "sglang-env": ("checks.targets.sglang.envs", (), "cached environments of SGLang releases: install | list | "
                                                    "python (docs/sglang.md)"),
    "fixtures": ("fixtures.__main__", (), "list or build the tiny fixture models"),
    "calibrate": ("checks.tools.calibrate", (), "calibrate the tolerance model on split-K GEMMs"),
    "bench": ("checks.tools.bench_gpu", (), "the GPU tier's figures: bench | tolerance | gemm (docs/gpu.md)"),
    "bench-harness": ("checks.tools.bench_harness", (), "harness throughput: world start and examples per second"),
    "bench-recovery": ("checks.tools.bench_recovery", (), "time to recover from a hang: restart forked or spawned"),
}

EPILOG = """\
Everything after the subcommand goes to it unchanged; `dpep SUB --help` shows its options.
The property suite itself runs under pytest: `python -m pytest property_tests ...` in this repository, or
`python -m pytest -p dpep --pyargs dpep_parity.property_tests` from anywhere (README.md).
Exit codes: the subcommand's own (README.md, "Exit codes"); 2 for an unknown subcommand."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dpep", description="Parity suite for DP-attention / TP / EP serving of "
                                 "MoE models: the tools.", epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, _, text) in COMMANDS.items():
        # add_help off: `dpep SUB --help` is the module's own help, not an empty one from here
        sub.add_parser(name, help=text, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Split at the subcommand: argparse sees only what comes before it (and the name itself), so the
    # subcommand's arguments reach it exactly as typed, --help included.
    cut = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    command = parser().parse_args(argv[:cut + 1]).command
    module, prefix, _ = COMMANDS[command]
    # kept in its own module, one copy whether this one runs as `dpep` or as `python -m checks.tools.cli` (__main__)
    progname.INVOKED = f"dpep {command}"
    try:
        rc = importlib.import_module(own_module(module)).main([*prefix, *argv[cut + 1:]])
    finally:
        progname.INVOKED = None
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
