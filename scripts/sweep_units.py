"""A fixed sweep: 4 fixtures x 8 layouts x 4 units x 2 dtypes on one mixed batch (dp0 extends after a
prefix and decodes, the other DP ranks alternate extend / idle); prints each verdict's worst excess and
the number of near-tie rows excused. Used for the figures in docs/property-suite.md.

    python scripts/sweep_units.py
"""
import time

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.units import UNITS
from dpep_parity.fixtures.build import fixture_path

LAYOUTS = [Layout(1), Layout(2), Layout(2, 2, 1), Layout(2, 2, 2), Layout(4, 2, 2), Layout(4, 4, 4),
           Layout(4, 1, 2), Layout(4, 2, 1)]


def main():
    for fx in ["qwen2-moe-shared", "qwen3-moe", "qwen2-moe-noshared", "qwen3-moe-dense"]:
        p = str(fixture_path(fx))
        for lay in LAYOUTS:
            for unit in UNITS:
                for dtype in ["float32", "bfloat16"]:
                    b = Batch(((Request(0, 5), Request(3, 1)),) +
                              tuple(((Request(2, 3),), ())[i % 2] for i in range(lay.dp - 1)), seed=1)
                    t = time.time()
                    r = run_example("spec", unit, p, lay, b, dtype, layer=units.get(unit).layer(1))
                    v = r.verdict
                    print(f"{fx:20s} {str(lay):14s} {unit:9s} {dtype:9s} ok={r.ok} {time.time() - t:.2f}s",
                          "" if r.ok else r.report()[:1500],
                          f"excess={v.worst_excess:.2f} ties={v.tie_rows}" if v else "", flush=True)


if __name__ == "__main__":
    main()
