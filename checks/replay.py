"""Replay one parity example exactly, as printed by a failing property:

    python -m checks.replay --target spec --unit moe --fixture qwen3-moe --layout tp4-dp2-ep2 \
        --dtype bfloat16 --layer 1 --batch 'dp0:0+5 dp1:idle seed=7'
"""
from __future__ import annotations

import argparse
import sys

from checks.batches import parse_batch
from checks.parity import run_example
from checks.topology import Layout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checks.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="spec")
    ap.add_argument("--unit", required=True, choices=("moe", "attention", "decoder", "model"))
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--layout", required=True, type=Layout.parse)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--batch", required=True, type=parse_batch)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--deadline", type=float, default=60.0)
    a = ap.parse_args(argv)
    from fixtures.build import fixture_path
    res = run_example(a.target, a.unit, str(fixture_path(a.fixture)), a.layout, a.batch, a.dtype, a.layer,
                      a.device, a.deadline)
    if res.skipped:
        print(f"skipped: {res.skipped}")
        return 0
    print(res.report())
    print("PASS" if res.ok else "FAIL")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
