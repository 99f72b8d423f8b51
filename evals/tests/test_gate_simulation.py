"""The whole gate's error rates, by simulation (evals.simulate), for the default matrix's sizes: false FAIL at
or below alpha for identical systems (0.5-2 % flips, independent and subject-correlated; the float64 truth
run and router near-tie flips at the measured rates, so the tolerance test is in the family), per scenario
and pooled, wrong PASS at or below alpha at the equivalence boundary. Seeded, so the verdicts are
deterministic; each rate is judged by an exact one-sided binomial test (it fails when the observed count is
improbable, p < 0.01, for a true rate of alpha), so a correct gate does not fail by the simulation's own noise.

Negative controls: a gate that adds a FAIL to 10 % of sign-offs fails the pooled check; the served tolerance
test's former per-token rule fails it under near-tie flips; the gate before issue 19 (McNemar and Bowker
assuming independent items, the Agresti-Min floored t interval for PASS, a FAIL when equivalence was not shown
"although the sample could show it"), rebuilt from the comparison records, must fail the same check. Positive control: the current gate with the
exact sign-flip difference test replaced by a normal-approximation one (a different but valid test) passes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats as sps

from dpep_parity.evals import gate as G
from dpep_parity.evals import stats
from dpep_parity.evals.simulate import Scenario, Sizes, fast_gate, per_token_rule, rates

pytestmark = pytest.mark.slow     # a whole sub-run per test (checks/suite/tiers.py)

ALPHA = 0.05
RUNS = 60
SIZES = Sizes(mmlu=600, gsm8k=800, gold_tokens=50, configs=4)   # the README main job (docs/evals.md)


def too_many(count_rate: float, runs: int = RUNS, alpha: float = ALPHA) -> bool:
    """Is the observed rate improbably high for a true rate of alpha (one-sided binomial p < 0.01)?"""
    k = round(count_rate * runs)
    return bool(sps.binom.sf(k - 1, runs, alpha) < 0.01)


def legacy_decide(comparisons: list[dict], gate) -> None:
    """The gate as of commit 7fa6670, on today's comparison records (negative control)."""
    fam = []
    for c in comparisons:
        c["p_old"] = stats.mcnemar_exact(c["b_base_only"], c["c_cfg_only"])
        fam.append((c, "p_old", c["p_old"]))
        if c["symmetry"]:
            c["sym_old"] = stats.bowker_symmetry(np.array(c["symmetry"]["table"]), n_mc=2000).p_exact
            fam.append((c, "sym_old", c["sym_old"]))
    for (c, key, _), adj in zip(fam, stats.holm([p for *_, p in fam])):
        c[key + "_holm"] = adj
    for c in comparisons:
        m, n = c["margin"], c["n"]
        se = max(c["se_delta"], stats.agresti_min_se(c["b_base_only"], c["c_cfg_only"], n))
        df = max((c["n_clusters"] or n) - 1, 1)
        t = stats.tost(c["delta"], se, m, df=df, alpha=gate.alpha)
        if c["p_old_holm"] < gate.alpha or c.get("sym_old_holm", 1) < gate.alpha:
            c["verdict"] = "FAIL"
        elif t.p < gate.alpha:
            c["verdict"] = "PASS"
        elif stats.equivalence_mdd(se, gate.alpha, gate.power) > m:
            c["verdict"] = "INCONCLUSIVE"
        else:
            c["verdict"] = "FAIL"


def normal_difference_test(comparisons: list[dict], gate) -> None:
    """Positive control: the current gate with a different valid difference test (the cluster-robust z test
    of the mean difference instead of the exact sign-flip test)."""
    for c in comparisons:
        if c["se_delta"] > 0:
            c["p_diff"] = float(2 * sps.norm.sf(abs(c["delta"]) / c["se_delta"]))
    G.decide(comparisons, gate)


AA = [Scenario(f"A/A {'correlated' if cor else 'independent'} {100 * f:g}%", f, cor)
      for f in (0.005, 0.01, 0.02) for cor in (False, True)]
# without the truth run: its tests can only add FAILs, so a boundary PASS rate without them bounds the one with
BOUNDARY = [Scenario(f"boundary {m} {100 * f:g}%", f, False, m, numerics=None) for m in G.MEASURES
            for f in (0.0, 0.01)]


def test_aa_false_fail_at_most_alpha_per_scenario_and_pooled():
    """Every A/A scenario (with the float64 truth run and router near-ties each run resolves on its own, at the
    measured rates: the tolerance test's pooled and tail tests are in the family) at most alpha, and the 360
    sign-offs pooled: a count that a gate with a true 10 % false-FAIL rate would exceed (next test)."""
    fails = {sc.name: rates(sc, SIZES, RUNS, seed=1)["fail"] for sc in AA}
    bad = {n: f for n, f in fails.items() if too_many(f)}
    assert not bad, f"false FAIL rates improbably above alpha over {RUNS} sign-offs: {bad}"
    pooled = sum(fails.values()) / len(fails)
    assert not too_many(pooled, RUNS * len(AA)), f"pooled false FAIL {pooled:.1%} of {RUNS * len(AA)} sign-offs"


def test_the_pooled_check_fails_a_gate_with_a_true_ten_percent_false_fail_rate():
    """The check's power, at the same 360 sign-offs: a gate that adds a FAIL to 10 % of sign-offs (seeded, on
    top of the real gate) is flagged. Small sign-offs: the check's power depends on the runs, not on their size."""
    extra = np.random.default_rng(9)

    def ten_percent(comparisons, gate):
        G.decide(comparisons, gate)
        if extra.random() < 0.10:
            comparisons[0]["verdict"] = "FAIL"
    small = Sizes(mmlu=57, gsm8k=60, gold_tokens=10, configs=1)
    runs = RUNS * len(AA)
    r = rates(AA[0], small, runs, seed=4, decide=ten_percent)
    assert 0.07 < r["fail"] < 0.14, r                          # what was planted (binomial noise of 360 runs)
    assert too_many(r["fail"], runs), r
    assert not too_many(rates(AA[0], small, runs, seed=4)["fail"], runs)   # the real gate on the same draws


def test_negative_control_the_per_token_rule_false_fails_under_near_tie_flips():
    """The served tolerance test's former per-token rule (FAIL when any reference token errs more than FACTOR x
    the baseline's largest error), outside the Holm family: with the measured near-tie flips each run resolves
    on its own it false-FAILs identical systems far above alpha (what issue 35's audit simulated)."""
    r = rates(AA[2], SIZES, RUNS, seed=5, decide=per_token_rule)
    assert too_many(r["fail"]), r


@pytest.mark.parametrize("sc", BOUNDARY, ids=lambda s: s.name)
def test_boundary_pass_at_most_alpha(sc):
    r = rates(sc, SIZES, RUNS, seed=2)
    assert not too_many(r["boundary_pass"]), \
        f"{sc.name}: the configuration 1 margin worse PASSed in {r['boundary_pass']:.1%} of {RUNS} sign-offs"


def test_negative_control_the_old_gate_fails_the_simulation():
    """The old gate's errors are what issue 19 measured: its false FAILs under subject-correlated flips
    (McNemar and Bowker assume independent items) and its boundary PASSes at few discordant items."""
    gate = dataclasses.replace(fast_gate(), margin=1.0)          # the old gate had one margin for all tasks
    aa = rates(Scenario("A/A correlated 2%", 0.02, True, numerics=None), SIZES, RUNS, seed=1, gate=gate,
               decide=legacy_decide)
    # issue 19's boundary case: a deterministic engine 1 point worse, 170 GSM8K items (the old floor let n >= 166
    # pass with no discordant item), one configuration
    edge = rates(Scenario("boundary gsm8k 0%", 0.0, False, "gsm8k", numerics=None),
                 dataclasses.replace(SIZES, mmlu=57, gsm8k=170, configs=1), 200, seed=2, gate=gate,
                 decide=legacy_decide)
    assert too_many(aa["fail"]), aa
    assert too_many(edge["boundary_pass"], runs=200), edge


def test_positive_control_another_valid_difference_test_passes():
    aa = rates(AA[3], SIZES, RUNS, seed=3, decide=normal_difference_test)
    edge = rates(BOUNDARY[2], SIZES, RUNS, seed=3, decide=normal_difference_test)
    assert not too_many(aa["fail"]), aa
    assert not too_many(edge["boundary_pass"]), edge
