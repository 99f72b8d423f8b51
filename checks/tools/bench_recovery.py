"""Time to recover from a hang: a hanging example, then a correct one on the world that replaces the hung one.

    python -m checks.tools.bench_recovery [--target sglang] [--hang checks.targets.sglang.mutants:S07] \
        [--fixture qwen3-moe] [--repeats 3] [--preload both|on|off]

The hang is the `--hang` target's MoE block at tp2-dp2-ep2 with DP rank 1 idle (S07: the idle rank skips the DP
gather's all-reduce); the recovery is the next example of `--target` with both DP ranks busy, which restarts the
world. `--preload on` forks the new ranks from the forkserver that imported the target's `preload_modules`,
`off` spawns them (DPEP_WORLD_PRELOAD=off, as before); `both` runs each in its own process, one after the
other. A markdown table on stdout (docs/harness.md, "Recovering from a hang"). Wall times of this process;
the machine's load shows in them, so run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _measure(a) -> dict:
    from dpep_parity.checks.core.batches import parse_batch
    from dpep_parity.checks.core.topology import Layout
    from dpep_parity.checks.harness.world import _POOL
    from dpep_parity.checks.judge.parity import run_example
    from dpep_parity.fixtures.build import fixture_path
    model, lay = str(fixture_path(a.fixture)), Layout(2, 2, 2)
    idle, busy = parse_batch("dp0:0+3 dp1:idle seed=6"), parse_batch("dp0:0+3 dp1:2+2 seed=6")

    def example(target, batch):
        t0 = time.monotonic()
        r = run_example(target, "moe", model, lay, batch, "float32", 1, deadline_s=a.deadline)
        return r, time.monotonic() - t0

    out = {"first": None, "hang": [], "recovery": [], "world_start": [], "errors": []}
    r, out["first"] = example(a.target, busy)
    if not r.ok:
        out["errors"].append(f"the correct example failed: {r.report()}")
        return out
    for _ in range(a.repeats):
        r, t = example(a.hang, idle)
        if not [c for c in r.failures() if c.prop == "liveness"]:
            out["errors"].append(f"{a.hang} did not hang: {[c.prop for c in r.failures()] or 'passed'}")
            return out
        out["hang"].append(t)
        r, t = example(a.target, busy)
        if not r.ok:
            out["errors"].append(f"the example after the hang failed: {r.report()}")
            return out
        out["recovery"].append(t)
        out["world_start"].append(_POOL[(2, "cpu")].start_seconds[-1])
    return out


def _row(mode: str, m: dict) -> str:
    if m["errors"]:
        return f"| {mode} | {'; '.join(m['errors'])[:300]} | | | |"

    def span(xs):
        return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"
    return (f"| {mode} | {m['first']:.1f} | {span(m['hang'])} | {span(m['recovery'])} | "
            f"{span(m['world_start'])} |")


def main(argv=None) -> int:
    from dpep_parity.progname import prog
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.bench_recovery"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="sglang", help="the correct target (default sglang)")
    ap.add_argument("--hang", default="checks.targets.sglang.mutants:S07",
                    help="a target that hangs on an idle DP rank (default SGLang broken step S07)")
    ap.add_argument("--fixture", default="qwen3-moe")
    ap.add_argument("--repeats", type=int, default=3, help="hang + recovery pairs per mode")
    ap.add_argument("--deadline", type=float, default=120.0, help="the examples' deadline (s)")
    ap.add_argument("--preload", choices=("both", "on", "off"), default="both")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)     # one mode's figures (internal)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    if a.json:
        print("DPEP-RECOVERY " + json.dumps(_measure(a)), flush=True)
        return 0
    modes = ("on", "off") if a.preload == "both" else (a.preload,)
    print("| ranks forked from a preloaded process | first example, world start included (s) | hang diagnosed (s) "
          "| example after the hang, restart included (s) | of which the world's start (s) |")
    print("|---|---|---|---|---|")
    rc = 0
    for mode in modes:
        env = {**os.environ, "DPEP_WORLD_PRELOAD": mode}
        cmd = [sys.executable, "-m", "dpep_parity.checks.tools.bench_recovery", "--json", "--target", a.target,
               "--hang", a.hang, "--fixture", a.fixture, "--repeats", str(a.repeats), "--deadline", str(a.deadline)]
        # each mode in a process of its own: the forkserver and its preload are per process
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.deadline * (3 * a.repeats + 2))
        line = next((x for x in p.stdout.splitlines() if x.startswith("DPEP-RECOVERY ")), None)
        if p.returncode or line is None:
            print(f"| {mode} | the measurement failed (exit {p.returncode}): {p.stderr.strip()[-300:]} | | | |")
            rc = 1
            continue
        m = json.loads(line.split(" ", 1)[1])
        rc |= bool(m["errors"])
        print(_row(mode, m), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
