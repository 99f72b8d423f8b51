"""The gate's statistics against statsmodels/scipy on synthetic paired data with known answers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import statsmodels.api as sm
from statsmodels.stats.contingency_tables import SquareTable, mcnemar
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import NormalIndPower
from statsmodels.stats.weightstats import ttost_paired

from dpep_parity.evals import stats


def _paired_binary(n, p_base, p_b, p_c, rng):
    """Paired correctness with P(base right, cfg wrong)=p_b, P(base wrong, cfg right)=p_c."""
    u = rng.random(n)
    yb = (rng.random(n) < p_base).astype(float)
    yc = yb.copy()
    flip_down = (yb == 1) & (u < p_b / p_base)
    flip_up = (yb == 0) & (u < p_c / (1 - p_base))
    yc[flip_down] = 0
    yc[flip_up] = 1
    return yb, yc


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (3, 9), (12, 11), (40, 25), (1, 30)])
def test_mcnemar_exact_matches_statsmodels(b, c):
    ref = mcnemar(np.array([[50, b], [c, 40]]), exact=True).pvalue
    assert stats.mcnemar_exact(b, c) == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_cluster_se_matches_statsmodels_ols():
    rng = np.random.default_rng(0)
    clusters = np.repeat(np.arange(23), rng.integers(3, 30, size=23))
    effect = rng.normal(0, 0.2, size=23)[clusters]
    y = (rng.random(clusters.size) < 0.5 + effect).astype(float)
    fit = sm.OLS(y, np.ones_like(y)).fit(cov_type="cluster", cov_kwds={"groups": clusters})
    m, se = stats.mean_se(y, clusters)
    assert m == pytest.approx(fit.params[0])
    assert se == pytest.approx(fit.bse[0], rel=1e-10)
    # and the iid SE is OLS's nonrobust one
    _, se2 = stats.mean_se(y)
    assert se2 == pytest.approx(sm.OLS(y, np.ones_like(y)).fit().bse[0], rel=1e-10)


def test_tost_matches_statsmodels_ttost_paired():
    rng = np.random.default_rng(1)
    x1 = rng.normal(0.0, 1.0, 60)
    x2 = x1 + rng.normal(0.05, 0.3, 60)
    margin = 0.2
    p_ref, lower, upper = ttost_paired(x2, x1, -margin, margin)
    d = x2 - x1
    r = stats.tost(d.mean(), d.std(ddof=1) / math.sqrt(d.size), margin, df=d.size - 1)
    assert r.p == pytest.approx(p_ref, rel=1e-9)
    assert r.p_lower == pytest.approx(lower[1], rel=1e-9)
    assert r.p_upper == pytest.approx(upper[1], rel=1e-9)


def test_tost_by_hand_and_degenerate():
    # normal TOST: diff 0.01, se 0.01, margin 0.03 -> max(P(Z > 4), P(Z < -2)) = Phi(-2)
    r = stats.tost(0.01, 0.01, 0.03)
    assert r.p == pytest.approx(0.022750131948179, rel=1e-9)
    q = 1.6448536 * 0.01
    assert (r.ci_low, r.ci_high) == pytest.approx((0.01 - q, 0.01 + q), rel=1e-6)
    assert stats.tost(0.0, 0.0, 0.01).p == 0.0 and stats.tost(0.02, 0.0, 0.01).p == 1.0


def test_agresti_min_never_zero():
    assert stats.agresti_min_se(0, 0, 40) == pytest.approx(1 / 42)
    # large samples: close to the Wald SE of the paired difference
    b, c, n = 300, 250, 10000
    wald = math.sqrt((b + c) - (b - c) ** 2 / n) / n
    assert stats.agresti_min_se(b, c, n) == pytest.approx(wald, rel=1e-2)


def test_bootstrap_ci_covers_truth():
    rng = np.random.default_rng(2)
    truth = 0.03 - 0.06  # p_c - p_b
    hits = 0
    reps = 200
    for r in range(reps):
        yb, yc = _paired_binary(400, 0.6, 0.06, 0.03, rng)
        lo, hi = stats.paired_bootstrap_ci(yb, yc, n_boot=1000, seed=r)
        hits += lo <= truth <= hi
    assert 0.90 <= hits / reps <= 0.99, hits / reps


def test_cluster_bootstrap_covers_truth_and_is_seeded():
    rng = np.random.default_rng(3)
    hits = 0
    reps = 150
    for r in range(reps):
        clusters = np.repeat(np.arange(40), 10)
        shift = rng.normal(0, 0.05, 40)[clusters]
        d = (rng.random(400) < 0.08 + shift).astype(float) - (rng.random(400) < 0.08).astype(float)
        lo, hi = stats.paired_bootstrap_ci(np.zeros(400), d, clusters, n_boot=800, seed=r)
        hits += lo <= 0.0 <= hi
    assert 0.88 <= hits / reps <= 0.995, hits / reps
    y = rng.integers(-1, 2, 50)
    zeros = np.zeros(50)
    assert stats.paired_bootstrap_ci(zeros, y, seed=5) == stats.paired_bootstrap_ci(zeros, y, seed=5)


def test_bowker_matches_statsmodels_and_exact_small_counts():
    t = np.array([[5, 3, 0, 1], [1, 6, 2, 0], [0, 0, 4, 1], [7, 0, 0, 3]])
    ref = SquareTable(t, shift_zeros=False).symmetry()
    r = stats.bowker_symmetry(t)
    assert r.statistic == pytest.approx(ref.statistic)
    assert r.df == ref.df
    assert r.p_asymptotic == pytest.approx(ref.pvalue)
    # 3 flips one way, none back: exact p = P(|2X-3| >= 3), X ~ Bin(3, 1/2) = 2/8
    small = np.zeros((4, 4), int)
    small[0, 1] = 3
    assert stats.bowker_symmetry(small).p_exact == pytest.approx(0.25)
    # a 2x2 table reduces to the exact McNemar test
    assert stats.bowker_symmetry([[10, 2], [9, 7]]).p_exact == pytest.approx(stats.mcnemar_exact(2, 9))
    # large counts: Monte Carlo p close to the chi-square p
    big = np.array([[100, 30, 20, 10], [45, 100, 25, 15], [20, 20, 100, 30], [12, 10, 40, 100]])
    rb = stats.bowker_symmetry(big, n_mc=40000, exact_limit=1000)
    assert rb.method.startswith("monte-carlo")
    assert rb.p_exact == pytest.approx(rb.p_asymptotic, abs=0.02)


def test_holm_matches_statsmodels():
    p = [0.01, 0.04, 0.03, 0.005, 0.2, 0.04]
    assert stats.holm(p) == pytest.approx(list(multipletests(p, method="holm")[1]))


def test_mdd_matches_statsmodels_power():
    # one-sample z test: effect size = MDD / sd with nobs n
    n, sd = 500, 0.3
    es = NormalIndPower().solve_power(effect_size=None, nobs1=n, alpha=0.05, power=0.8, ratio=0)
    # (statsmodels also counts the far tail's tiny rejection probability: equal to 1e-5)
    assert stats.mdd(sd / math.sqrt(n)) == pytest.approx(es * sd, rel=1e-5)
    # the equivalence MDD gives TOST power 0.8 at a true difference of 0
    se = 0.01
    m = stats.equivalence_mdd(se)
    rng = np.random.default_rng(4)
    est = rng.normal(0, se, 20000)
    power = np.mean([stats.tost(e, se, m).p < 0.05 for e in est[:4000]])
    assert power == pytest.approx(0.8, abs=0.03)
