"""The invariance properties' controls (checks/judge/invariance.py, property_tests/test_invariance.py): every invariance
mutant stays inside the tolerance model (parity passes) and breaks its promise (the property kills it, on a
pinned pair and in the ci profile's search); the batch-invariant spec passes the same pairs; the plain spec, which
promises nothing, drifts (why the property exists)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpep_parity.checks.catalog.invariance_mutants import CATALOG
from dpep_parity.checks.core.batches import Request, parse_batch
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge import invariance
from dpep_parity.checks.judge.invariance import Context, Pair
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.fixtures.build import fixture_path

# per mutant: the smallest pair its property shrank to (unit, fixture, layer, layout [and B's layout], context A,
# context B)
PAIRS = {
    "I01": ("model", "qwen3-moe", 0, "tp1", "dp0:1+1@900 seed=0", "dp0:1+1@900,0+1@100 seed=0"),
    "I02": ("moe", "qwen3-moe", 1, "tp1", "dp0:0+1@900 seed=0", "dp0:0+1@900,0+4@100 seed=0"),
    "I03": ("attention", "qwen2-moe-noshared", 0, "tp2-dp2-ep1", "dp0:1+1@900 dp1:idle seed=0",
            "dp0:idle dp1:1+1@900 seed=0"),
    "I04": ("moe", "qwen3-moe", 1, "tp2-dp2-ep1", "dp0:4+1@900 dp1:idle seed=1",
            "dp0:4+1@900 dp1:3+1@0,3+1@1,3+1@2 seed=1"),
    "I05": ("moe", "qwen2-moe-noshared", 1, "tp1 tp2-dp2-ep2", "dp0:0+2@900 seed=0", "dp0:0+2@900 dp1:idle seed=0"),
}
INVARIANT = "checks.catalog.variants:BATCH_INVARIANT"


def _pair(m: str) -> Pair:
    unit, fixture, layer, layouts, a, b = PAIRS[m]
    la, lb = (Layout.parse(t) for t in (layouts.split() * 2)[:2])
    return Pair(fixture, unit, "float32", layer, Context(la, parse_batch(a)), Context(lb, parse_batch(b)))


def test_every_invariance_mutant_has_a_pinned_pair():
    assert sorted(PAIRS) == sorted(CATALOG)
    for m, mut in CATALOG.items():
        assert _pair(m).kind in mut.kills, (m, _pair(m).kind)


@pytest.mark.parametrize("m", sorted(CATALOG))
def test_invariance_mutant_breaks_its_promise_inside_the_tolerance_model(m):
    pair = _pair(m)
    model = str(fixture_path(pair.fixture))
    bad = invariance.measure(pair, f"checks.catalog.invariance_mutants:{m}", model)
    assert not bad.unjudged and bad.changed, bad.report()              # negative control: the property fails
    good = invariance.measure(pair, INVARIANT, model)
    assert good.equal, good.report()                                   # positive control: the same pair passes
    for ctx in (pair.a, pair.b):                                       # and parity cannot see the mutant
        res = run_example(f"checks.catalog.invariance_mutants:{m}", pair.unit, model, ctx.layout, ctx.batch, "float32",
                          pair.layer)
        assert res.ok, res.report()


def test_the_plain_spec_drifts_and_promises_nothing():
    """Why the property exists: the spec passes parity yet a request's bits change with its batch on CPU
    (GEMM blocking by row count; vectorised body against scalar tail of elementwise kernels)."""
    from dpep_parity.checks.targets.protocol import resolve
    assert invariance.claims(resolve("spec")) == frozenset()
    pair = _pair("I02")
    d = invariance.measure(pair, "spec", str(fixture_path(pair.fixture)))
    assert not d.unjudged and d.changed, d.report()


@pytest.mark.slow
@pytest.mark.parametrize("m", sorted(CATALOG))
def test_the_search_kills_each_invariance_mutant_in_the_ci_profile(m):
    """The property itself (hypothesis, ci profile) finds a breaking pair, on the kinds the mutant names."""
    kinds = " or ".join(CATALOG[m].kills)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "property_tests/test_invariance.py", "--target", f"checks.catalog.invariance_mutants:{m}", "--world-sizes", "1,2",
           "--dtypes", "float32", "-k", kinds]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root,
                         env={**os.environ, "DPEP_PROFILE": "ci"})
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "promises" in text and "replay: dpep invariance pair" in text, \
        text[-3000:]


def test_claims_are_checked_and_pairs_classified():
    class T:
        invariances = ("batch", "bitwise-everything")
    with pytest.raises(ValueError, match="unknown invariances"):
        invariance.claims(T())
    lay = Layout.parse("tp2-dp2-ep1")
    same = Context(lay, parse_batch("dp0:0+2@900 dp1:0+1@1 seed=1"))
    assert Pair("qwen3-moe", "moe", "float32", 0, same,
                Context(lay, parse_batch("dp0:0+2@900,0+3@5 dp1:0+1@1 seed=1"))).kind == "batch"
    assert Pair("qwen3-moe", "moe", "float32", 0, same,
                Context(lay, parse_batch("dp0:0+2@900 dp1:idle seed=1"))).kind == "placement"
    assert Pair("qwen3-moe", "moe", "float32", 0, same,
                Context(lay, parse_batch("dp0:idle dp1:0+2@900 seed=1"))).kind == "placement"
    assert Pair("qwen3-moe", "moe", "float32", 0, same,
                Context(Layout.parse("tp2-dp2-ep2"), same.batch)).kind == "layout"
    b = parse_batch("dp0:0+3@7,2+1 dp1:idle seed=4")
    assert b.per_dp[0][0] == Request(0, 3, 7) and parse_batch(b.describe()) == b
