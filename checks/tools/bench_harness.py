"""Harness throughput: world start time and MoE-block examples per second, reused world vs a fresh world
per example.

    python -m checks.tools.bench_harness [--sizes 2,4] [--examples 40] [--fixture qwen2-moe-shared]

The spec target's MoE block of the fixture at layout tp = dp = ep = N, float32, batches with idle ranks;
rank-side time only (the oracle does not run). A markdown table on stdout (docs/harness.md).
"""
from __future__ import annotations

import argparse
import sys
import time

from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.unitjob import UnitJob
from dpep_parity.checks.harness.world import World
from dpep_parity.progname import prog


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.bench_harness"), description=__doc__.split("\n\n")[0],
                                 epilog="Writes a markdown table to stdout (docs/harness.md).")
    ap.add_argument("--sizes", default="2,4", help="comma-separated world sizes (ranks), e.g. 2,4")
    ap.add_argument("--examples", type=int, default=40, help="examples per world size (reused world)")
    ap.add_argument("--fixture", default="qwen2-moe-shared", help="fixture model (dpep fixtures list)")
    a = ap.parse_args(argv)
    from dpep_parity.fixtures.build import fixture_path
    path = str(fixture_path(a.fixture))
    print("| ranks | world start (s) | reused world: examples/s | fresh world per example: examples/s |")
    print("|---|---|---|---|")
    for n in map(int, a.sizes.split(",")):
        lay = Layout(n, n, n)
        jobs = [UnitJob("spec", "moe", path, lay,
                        Batch(tuple(((Request(0, 1 + (i + d) % 5),) if (i + d) % 3 else ()) for d in range(n)), i),
                        "float32") for i in range(a.examples)]
        w = World(n)
        t0 = time.perf_counter()
        w.start()
        start = time.perf_counter() - t0
        w.run(jobs[0])                       # builds the sharded module once
        t0 = time.perf_counter()
        for j in jobs:
            w.run(j)
        reused = len(jobs) / (time.perf_counter() - t0)
        w.close()
        fresh_n = min(5, len(jobs))
        t0 = time.perf_counter()
        for j in jobs[:fresh_n]:
            with World(n) as f:
                f.run(j)
        fresh = fresh_n / (time.perf_counter() - t0)
        print(f"| {n} | {start:.2f} | {reused:.1f} | {fresh:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
