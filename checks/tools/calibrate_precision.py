"""Calibration of the precision test (checks.core.numerics, "precision"): `python -m checks.tools.calibrate --precision`.

For each unit, the same deterministic examples (every DP rank busy, short and long prefixes, layouts of
world sizes 1, 2 and 4, the fixtures in turn, bfloat16) run through the spec, its legitimate variants
(checks/catalog/variants.py: other expert orders, float32 expert accumulation, all-reduce as all-gather +
a local sum in another rank order, reduce-scatter as all-reduce + slice) and the catalog's precision mutants.
Printed per target and unit: the pooled mean log energy ratio against the largest legitimate error, its z
over tokens, and the verdict. The model holds when every legitimate target passes with a mean below 0 and
every mutant fails on at least one unit, pooled or by another check of its examples (the property needs
only one unit to catch it).
"""
from __future__ import annotations

import random
import time

from dpep_parity.checks import units as registry
from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.numerics import PrecisionPool
from dpep_parity.checks.core.topology import valid_layouts
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.protocol import family_skip, resolve
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.fixtures.specs import FIXTURES

LEGIT = ["spec"] + [f"checks.catalog.variants:{v}" for v in ("EXPERTS_REVERSED", "EXPERTS_FP32_ACCUMULATE",
                                                            "ALL_REDUCE_BY_GATHER", "REDUCE_SCATTER_BY_ALL_REDUCE")]


def mutants() -> list[str]:
    from dpep_parity.checks.catalog.mutants import CATALOG
    return [f"checks.catalog.mutants:{i}" for i, m in CATALOG.items() if m.kind == "precision"]


def examples(n: int, unit: str, seed: int = 0):
    """`n` examples as the property draws them (property_tests/test_precision.py), from a fixed seed."""
    rng = random.Random(f"{seed}-{unit}")
    spec = resolve("spec")
    fixtures = [f for f in sorted(FIXTURES) if not family_skip(spec, FIXTURES[f])]   # the spec's families
    for i in range(n):
        fx = fixtures[i % len(fixtures)]
        whole = registry.get(unit).whole_model
        lays = [lay for ws in (1, 2, 4) for lay in valid_layouts(ws, fixture_config(fx), dp_lm_head=whole)]
        lay = rng.choice(lays)
        per = tuple(tuple(Request(rng.choice([rng.randint(0, 4), rng.randint(64, 200)]), rng.randint(16, 32))
                          for _ in range(rng.randint(2, 4))) for _ in range(lay.dp))
        layer = 0 if whole else rng.randrange(FIXTURES[fx].num_hidden_layers)
        yield fx, lay, Batch(per, rng.randrange(2**16)), layer


def measure(target: str, unit: str, n: int) -> dict:
    pool, failed = PrecisionPool(), 0
    for fx, lay, batch, layer in examples(n, unit):
        res = run_example(target, unit, str(fixture_path(fx)), lay, batch, "bfloat16", layer,
                          layout_reference=True)
        if res.skipped:
            continue
        failed += not res.ok
        pool.add(f"{fx} {lay} [{batch.describe()}]", res.precision or [])
    v = pool.verdict()
    return {"target": target, "unit": unit, "mean": v.mean, "z": v.z, "tokens": v.tokens, "ok": v.ok,
            "other_failures": failed}


def run(n: int = 24, units=registry.UNITS) -> tuple[bool, list[dict]]:
    t0 = time.perf_counter()
    rows, holds = [], True
    print(f"{'target':48s} {'unit':9s} {'mean l':>7s} {'z':>6s} {'tokens':>6s}  verdict")
    for target in LEGIT + mutants():
        legit = target in LEGIT
        caught = False
        for unit in units:
            r = measure(target, unit, n)
            rows.append(r)
            caught |= not r["ok"] or r["other_failures"] > 0
            if legit and (not r["ok"] or r["mean"] > 0 or r["other_failures"]):
                holds = False
            other = f" (other checks failed on {r['other_failures']} examples)" if r["other_failures"] else ""
            print(f"{target:48s} {unit:9s} {r['mean']:+7.3f} {r['z']:6.1f} {r['tokens']:6d}  "
                  f"{'pass' if r['ok'] else 'FAIL'}{other}", flush=True)
        if not legit and not caught:
            holds = False
    print(f"{'precision model holds' if holds else 'PRECISION MODEL BROKEN'}: legitimate targets pass below 0, "
          f"every precision mutant fails on some unit ({time.perf_counter() - t0:.0f}s, {n} examples per unit)")
    return holds, rows
