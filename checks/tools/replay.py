"""Replay one parity example exactly, as printed by a failing property:

    python -m checks.tools.replay --target spec --unit moe --fixture qwen3-moe --layout tp4-dp2-ep2 \
        --dtype bfloat16 --layer 1 --batch 'dp0:0+5 dp1:idle seed=7'
"""
from __future__ import annotations

import argparse
import sys

from dpep_parity.checks.core.batches import DTYPES, batch_problems, parse_batch
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.units import UNITS
from dpep_parity.progname import prog


def parser() -> argparse.ArgumentParser:
    """The replay line's grammar (also read by `dpep bisect`, which takes a replay line)."""
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.replay"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="spec")
    ap.add_argument("--unit", required=True, choices=UNITS)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--layout", required=True, type=_checked(Layout.parse))
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--batch", required=True, type=_checked(parse_batch))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--precision", action="store_true",
                    help="also run the spec at the same layout and print the precision test's evidence "
                         "(half-precision dtypes; the test itself pools many examples: test_precision.py)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    bad = problems(a)
    if bad:     # a usage error (exit 2) before any rank starts, every problem at once
        ap.error("\n  ".join(["the example cannot run:", *bad]))
    from dpep_parity.checks.targets.protocol import HarnessFault
    from dpep_parity.fixtures.build import fixture_path
    try:
        res = run_example(a.target, a.unit, str(fixture_path(a.fixture)), a.layout, a.batch, a.dtype, a.layer,
                          a.device, a.deadline, layout_reference=a.precision)
    except HarnessFault as e:
        print(e)
        print("ERROR")
        return 3
    if res.skipped:
        print(f"skipped: {res.skipped}")
        return 0
    print(res.report())
    print("PASS" if res.ok else "FAIL")
    return 0 if res.ok else 1


def _checked(parse):
    """An argparse type whose error message says what is wrong (argparse hides a ValueError's text)."""
    def run(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    run.__name__ = parse.__name__
    return run


def problems(a) -> list[str]:
    from dpep_parity.checks.core.topology import layout_violations
    from dpep_parity.checks.targets.protocol import resolve
    from dpep_parity.fixtures.families import fixture_config
    from dpep_parity.fixtures.specs import FIXTURES

    out = []
    if a.fixture not in FIXTURES:
        out.append(f"--fixture {a.fixture!r} is unknown; known: {sorted(FIXTURES)}")
    else:
        spec = FIXTURES[a.fixture]
        out += [f"--layout {a.layout} on {a.fixture}: {v}"
                for v in layout_violations(a.layout, fixture_config(a.fixture))]
        if not 0 <= a.layer < spec.num_hidden_layers:
            out.append(f"--layer {a.layer}: {a.fixture} has layers 0..{spec.num_hidden_layers - 1}")
        out += [f"--batch: {p}" for p in batch_problems(a.batch, fixture_config(a.fixture), a.fixture)]
    if len(a.batch.per_dp) != a.layout.dp:
        out.append(f"--batch names {len(a.batch.per_dp)} DP ranks, --layout {a.layout} has dp={a.layout.dp}")
    try:
        resolve(a.target)
    except ValueError as e:
        out.append(f"--target: {e}")
    return out


if __name__ == "__main__":
    sys.exit(main())
