"""Paired statistics for accuracy parity (pure numpy/scipy; checked against statsmodels in the tests).

Conventions: accuracies and differences are fractions in [0, 1] here; the gate and the report show
percentage points. ``d_i = y_cfg_i - y_base_i`` is the paired difference of per-item correctness.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy import special as sc
from scipy import stats as sps

Z_POWER_08 = float(sps.norm.ppf(0.8))


# ------------------------------------------------------------------------------------ standard errors
def mean_se(y, clusters=None, *, inverse=None) -> tuple[float, float]:
    """Mean of ``y`` and its standard error: iid (sample sd, ddof=1) or cluster-robust.

    The cluster-robust form is statsmodels' OLS ``y ~ 1`` with ``cov_type='cluster'`` (default small
    sample correction G/(G-1) * (N-1)/(N-K), K=1): V = G/(G-1) * sum_g (sum_{i in g} u_i)^2 / N^2.
    ``inverse``: the cluster index of each unit as ``np.unique(clusters, return_inverse=True)`` gives it, when
    the caller has it already (the gate: sorting tens of thousands of string labels again for every mean is
    most of this function's time).
    """
    y = np.asarray(y, dtype=float)
    n = y.size
    if n == 0:
        return float("nan"), float("nan")
    m = float(y.mean())
    if n == 1:
        return m, float("nan")
    if clusters is None:
        return m, float(y.std(ddof=1) / math.sqrt(n))
    inv = np.unique(np.asarray(clusters), return_inverse=True)[1] if inverse is None else inverse
    g = int(inv.max()) + 1
    if g < 2:
        return m, float("nan")
    sums = np.bincount(inv, weights=y - m, minlength=g)
    var = g / (g - 1) * float(np.sum(sums ** 2)) / n ** 2
    return m, math.sqrt(var)


def agresti_min_se(b: int, c: int, n: int) -> float:
    """SE of a paired difference of proportions after adding 1/2 to each cell (Agresti & Min, 2005).

    It never collapses to zero: with no discordant pairs at all it is 1/(n+2), the resolution that
    ``n`` paired items can claim.
    """
    bt, ct, nt = b + 0.5, c + 0.5, n + 2.0
    var = ((bt + ct) - (bt - ct) ** 2 / nt) / nt ** 2
    return math.sqrt(max(var, 0.0))


# ------------------------------------------------------------------------------------ tests
def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of b vs c discordant pairs at p=1/2.

    Same as ``statsmodels.stats.contingency_tables.mcnemar(table, exact=True)``.
    """
    n = int(b) + int(c)
    if n == 0:
        return 1.0
    return float(min(1.0, 2.0 * sps.binom.cdf(min(b, c), n, 0.5)))


@dataclass
class SymmetryResult:
    statistic: float
    df: int
    p_asymptotic: float
    p_exact: float
    method: str


def bowker_symmetry(table, n_mc: int = 20000, seed: int = 0, exact_limit: int = 200_000) -> SymmetryResult:
    """Bowker's test that a square table of paired categorical outcomes is symmetric.

    Used on the table (baseline answer x configuration answer): an engine bug that favours one
    answer (a bias on one token) makes flips one-directional. The statistic matches statsmodels'
    ``SquareTable(table, shift_zeros=False).symmetry()``; the p-value used is exact conditional on the
    pair totals (under H0 n_ij ~ Bin(n_ij + n_ji, 1/2)), by enumeration when small and by seeded Monte
    Carlo otherwise, because the chi-square approximation is anti-conservative for the few flips a
    healthy engine has.
    """
    t = np.asarray(table, dtype=float)
    k = t.shape[0]
    pairs = [(i, j) for i, j in itertools.combinations(range(k), 2)]
    m = np.array([t[i, j] + t[j, i] for i, j in pairs])
    x = np.array([t[i, j] for i, j in pairs])
    used = m > 0
    if not used.any():
        return SymmetryResult(0.0, 0, 1.0, 1.0, "no off-diagonal counts")
    mu, xu = m[used].astype(int), x[used]
    stat = float(np.sum((2 * xu - mu) ** 2 / mu))
    df = len(pairs)  # as statsmodels and R's mcnemar.test
    p_asym = float(sps.chi2.sf(stat, df))
    if float(np.prod(mu + 1.0)) <= exact_limit:
        dist = {0.0: 1.0}
        for mi in mu:
            vals = (2 * np.arange(mi + 1) - mi) ** 2 / mi
            probs = sps.binom.pmf(np.arange(mi + 1), mi, 0.5)
            new: dict[float, float] = {}
            for s, p in dist.items():
                for v, q in zip(vals, probs):
                    key = round(s + float(v), 9)
                    new[key] = new.get(key, 0.0) + p * q
            dist = new
        p_exact = float(sum(p for s, p in dist.items() if s >= stat - 1e-9))
        method = "exact"
    else:
        rng = np.random.default_rng(seed)
        draws = rng.binomial(mu, 0.5, size=(n_mc, mu.size))
        sims = np.sum((2 * draws - mu) ** 2 / mu, axis=1)
        p_exact = float((1 + np.sum(sims >= stat - 1e-9)) / (n_mc + 1))
        method = f"monte-carlo ({n_mc}, seed {seed})"
    return SymmetryResult(stat, df, p_asym, min(1.0, p_exact), method)


@dataclass
class TostResult:
    p: float
    p_lower: float
    p_upper: float
    ci_low: float  # (1 - 2 alpha) confidence interval of the difference
    ci_high: float


def tost(diff: float, se: float, margin: float, df: float | None = None, alpha: float = 0.05) -> TostResult:
    """Two one-sided tests of H0: |delta| >= margin against H1: |delta| < margin.

    With ``se = sd(d)/sqrt(n)`` and ``df = n - 1`` this is statsmodels' ``ttost_paired``;
    ``df=None`` uses the normal distribution.
    """
    # the distribution's methods with its shape argument, not a frozen `sps.t(df)`: freezing costs ~0.8 ms, more
    # than the three evaluations (the simulation calls this hundreds of times per sign-off); same values
    dist, args = (sps.norm, ()) if df is None else (sps.t, (df,))
    if not se > 0:
        inside = -margin < diff < margin
        p = 0.0 if inside else 1.0
        return TostResult(p, p, p, diff, diff)
    p_lower = float(dist.sf((diff + margin) / se, *args))   # H0: delta <= -margin
    p_upper = float(dist.cdf((diff - margin) / se, *args))  # H0: delta >= +margin
    q = float(dist.ppf(1 - alpha, *args))
    return TostResult(max(p_lower, p_upper), p_lower, p_upper, diff - q * se, diff + q * se)


# ------------------------------------------------------------------------------------ bootstrap
def paired_bootstrap_ci(y_base, y_cfg, clusters=None, n_boot: int = 2000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float]:
    """Percentile CI of mean(y_cfg - y_base), resampling paired items (or whole clusters).

    Each resampled unit carries both arms, so the pairing is kept. ``clusters`` (MMLU subjects)
    makes it a cluster bootstrap, consistent with the cluster-robust standard error.
    """
    d = np.asarray(y_cfg, dtype=float) - np.asarray(y_base, dtype=float)
    if d.size == 0 or n_boot <= 0:
        return float("nan"), float("nan")
    if clusters is None:
        sums, counts = d, np.ones_like(d)
    else:
        _, inv = np.unique(np.asarray(clusters), return_inverse=True)
        sums = np.bincount(inv, weights=d)
        counts = np.bincount(inv).astype(float)
    g = sums.size
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, g, size=(n_boot, g))
    means = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return float(lo), float(hi)


# ------------------------------------------------------------------------------------ power
@functools.lru_cache(maxsize=256)
def _z(q: float) -> float:
    """Standard normal quantile. Cached: the gate needs the same few levels for every comparison, and a scipy
    call costs ~0.15 ms."""
    return float(sps.norm.ppf(q))


def mdd(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable difference of a two-sided z test with standard error ``se``."""
    return float((_z(1 - alpha / 2) + _z(power)) * se)


def mdd_under_drop(n: int, flip_rate: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable difference of a two-sided z test on n paired items when the difference itself adds
    discordance: a true drop d turns d of the items one way on top of ``flip_rate`` symmetric flips, so the
    discordant rate is flip_rate + d and the per-item variance flip_rate + d - d^2. The d with
    d = k sqrt((flip_rate + d - d^2) / n), k = z(1 - alpha/2) + z(power), in closed form. Larger than
    mdd(planned_se(n, flip_rate)), which takes the no-difference discordance (what the plan printed before)."""
    if n <= 0:
        return float("inf")
    k2 = (_z(1 - alpha / 2) + _z(power)) ** 2
    return float((k2 + math.sqrt(k2 * k2 + 4 * (n + k2) * k2 * flip_rate)) / (2 * (n + k2)))


def equivalence_mdd(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """Smallest margin that TOST shows with probability ``power`` when the true difference is 0."""
    return float((_z(1 - alpha) + _z(1 - (1 - power) / 2)) * se)


def planned_se(n: int, flip_rate: float) -> float:
    """SE of the paired difference before the run: flips (discordant items) at ``flip_rate``, mean 0.

    Never below the zero-flip resolution of :func:`agresti_min_se`.
    """
    return max(math.sqrt(flip_rate / n), agresti_min_se(0, 0, n)) if n > 0 else float("inf")


# ------------------------------------------------------------------------------------ multiplicity
def holm(pvalues) -> list[float]:
    """Holm-Bonferroni adjusted p-values (as ``statsmodels multipletests(method='holm')``)."""
    p = np.asarray(list(pvalues), dtype=float)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p, kind="stable")
    adj = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, (m - rank) * p[i])
        adj[i] = min(1.0, running)
    return adj.tolist()


# ------------------------------------------------------------------------------------ cluster-aware tests
def signflip_test(cluster_sums) -> float:
    """Two-sided exact test that paired differences are symmetric about 0, with items dependent within
    clusters: under H0 each cluster's sum of differences is as likely to carry either sign, so the p-value is
    P(|sum_g +-s_g| >= |sum_g s_g|) over the 2^G sign patterns, computed exactly by convolution over the
    integer sums (differences of 0/1 outcomes). With one item per cluster it is the exact McNemar test
    (conditional on the discordant pairs); with subjects as clusters it stays valid when flips correlate
    within a subject, where McNemar's independence assumption does not hold."""
    s = np.abs(np.asarray(cluster_sums, dtype=np.int64))
    s = s[s > 0]
    if s.size == 0:
        return 1.0
    observed = abs(int(np.asarray(cluster_sums, dtype=np.int64).sum()))
    total = int(s.sum())
    # `dist`: the distribution of the partial sum over its support so far, [-(sum so far), +(sum so far)] (every
    # entry outside is 0 and stays 0 until the support widens over it); each step is new[x] = 0.5 * (old[x - v] +
    # old[x + v]) over the widened support. The same additions and halvings as over the whole [-total, total]
    # array (adding a 0 is exact), so the same floats, without the work on the zeros; after the last cluster the
    # support is [-total, total].
    dist = np.ones(1)
    for v in s.tolist():
        new = np.zeros(dist.size + 2 * v)
        new[2 * v:] = dist                                   # old[x - v]
        new[:dist.size] += dist                              # old[x + v]
        dist = 0.5 * new
    values = np.abs(np.arange(-total, total + 1))
    return float(min(1.0, dist[values >= observed].sum()))


def _sign_patterns(g: int) -> np.ndarray:
    """Every one of the 2^g sign vectors of g clusters, one per row, as +-1 floats."""
    return (1 - 2 * ((np.arange(2 ** g)[:, None] >> np.arange(g)) & 1)).astype(float)


def _flipped_sums(rng, k: int, m: np.ndarray) -> np.ndarray:
    """sum_g sign_g * m[g] for k draws of independent fair signs, [k, columns] (m: [g, columns]). The signs
    come as bits, eight per random byte (1 - 2 b): a quarter of the time of drawing them as floats."""
    g = m.shape[0]
    bits = np.unpackbits(rng.integers(0, 256, (k, (g + 7) // 8), dtype=np.uint8), axis=1, count=g)
    return m.sum(0) - 2 * (bits.astype(m.dtype) @ m)


def signflip_greater(cluster_sums, n_mc: int = 20000, seed: int = 0, exact_limit: int = 16) -> float:
    """One-sided sign-flip test that real-valued paired cluster sums have a mean above 0: under H0 (mean 0,
    each cluster's sum as likely to carry either sign, whatever the dependence inside the cluster) the p-value
    is P(sum_g +-s_g >= sum_g s_g), exact over the sign patterns of few clusters, seeded Monte Carlo otherwise
    (the exact convolution of `signflip_test` needs integer sums). A mean below 0 only makes it larger."""
    s = np.asarray(cluster_sums, dtype=float)
    s = s[s != 0]
    if s.size == 0:
        return 1.0
    observed = float(s.sum())
    tol = 1e-9 * float(np.abs(s).sum())
    if s.size <= exact_limit:
        return float(np.mean(_sign_patterns(s.size) @ s >= observed - tol))
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    while done < n_mc:                                    # blocks keep memory at ~16 MB for any cluster count
        k = min(n_mc - done, max(1, (1 << 22) // s.size))
        hits += int(np.sum(_flipped_sums(rng, k, s[:, None])[:, 0] >= observed - tol))
        done += k
    return float((1 + hits) / (n_mc + 1))


@dataclass(frozen=True)
class TailResult:
    p: float
    size: int              # the tail (pooled tokens) at which the standardised excess was largest
    cfg: int               # the configuration's tokens in that tail ...
    base: int              # ... and the baseline's
    statistic: float       # max over tail sizes of (summed excess) / sqrt(sum of squared cluster excesses)
    worst_cluster: int | None   # the cluster with the largest excess at that tail, None when none is positive


def tail_signflip(base, cfg, n_mc: int = 20000, seed: int = 0, exact_limit: int = 16) -> TailResult:
    """Does the configuration own more of the pooled tail than its share? Per cluster c, token-aligned error
    arrays base[c] and cfg[c] (the configuration's already divided by the factor the tolerance model allows).

    H0 (the boundary of the tolerance model): in every cluster the pair (base[c], cfg[c]) is exchangeable,
    i.e. the configuration errs FACTOR times as much as a rerun of the baseline would. Pool every value of both
    runs; for each tail size m = 1, 2, 4, ... (up to one run's token count) take the values at or above the m-th
    largest and per cluster count the configuration's minus the baseline's, s_c(m). Swapping the two runs in a
    cluster leaves the pooled values, hence every tail, unchanged and negates s_c(m) for every m at once, so the
    sign-flip distribution of T = max_m sum_c s_c(m) / sqrt(sum_c s_c(m)^2) is exact under H0 (enumerated over
    few clusters, seeded Monte Carlo otherwise), whatever the dependence inside a cluster (a wrong step
    corrupts later tokens). A configuration better than the boundary owns less of every tail: the test is
    conservative there. The maximum over tail sizes is the search for where a fault's excess sits (its handful
    of tokens or a broad shoulder) without a tuned quantile; the flips pay for the search.

    Why a tail and not the largest value: each run resolves some router near-ties on its own, and a token
    routed to another expert errs by up to nats (heavy-tailed); the largest of one run against FACTOR times
    the largest of the other is an extreme-value comparison whose level nobody controls. Here a run's own
    near-tie flips are as likely in either run, so they cannot drive T."""
    base = [np.asarray(b, dtype=float).ravel() for b in base]
    cfg = [np.asarray(c, dtype=float).ravel() for c in cfg]
    g = len(base)
    lengths = np.array([b.size for b in base])
    if g == 0 or lengths.sum() == 0:
        return TailResult(1.0, 0, 0, 0, 0.0, None)
    vb, vc = np.concatenate(base), np.concatenate(cfg)
    db = np.repeat(np.arange(g), lengths)
    dc = np.repeat(np.arange(g), [c.size for c in cfg])
    pooled = np.sort(np.concatenate([vb, vc]))[::-1]
    sizes = [1 << j for j in range(int(math.log2(vb.size)) + 1)]
    cuts = pooled[np.array(sizes) - 1]
    s = np.stack([np.bincount(dc[vc >= v], minlength=g) - np.bincount(db[vb >= v], minlength=g)
                  for v in cuts], axis=1).astype(float)          # [clusters, tail sizes]
    sd = np.sqrt((s ** 2).sum(0))
    keep = sd > 0
    if not keep.any():
        return TailResult(1.0, sizes[0], 0, 0, 0.0, None)
    s, sd, kept = s[:, keep], sd[keep], [m for m, k in zip(sizes, keep) if k]
    live = np.flatnonzero((s != 0).any(1))                        # clusters that never differ cannot move T
    z = s.sum(0) / sd
    j = int(np.argmax(z))
    observed = float(z[j])
    tol = 1e-9 * max(1.0, abs(observed))
    sl = s[live] / sd                                             # standardised: T = max over columns
    if live.size <= exact_limit:
        p = float(np.mean((_sign_patterns(live.size) @ sl).max(1) >= observed - tol))
    else:
        rng = np.random.default_rng(seed)
        sl32 = sl.astype(np.float32)        # float32 sums: their rounding (~1e-7 relative) is far below tol's
        tol32 = max(tol, 1e-5 * float(np.abs(sl).sum(0).max()))
        hits, done = 0, 0
        while done < n_mc:
            k = min(n_mc - done, max(1, (1 << 22) // live.size))
            hits += int(np.sum(_flipped_sums(rng, k, sl32).max(1) >= observed - tol32))
            done += k
        p = float((1 + hits) / (n_mc + 1))
    v = cuts[keep][j]
    worst = int(np.argmax(s[:, j])) if s[:, j].max() > 0 else None
    return TailResult(p, kept[j], int((vc >= v).sum()), int((vb >= v).sum()), observed, worst)


def cluster_symmetry(tables, n_mc: int = 20000, seed: int = 0, exact_limit: int = 16) -> SymmetryResult:
    """Bowker's symmetry statistic on the summed (baseline answer x configuration answer) table, with its
    p-value from the clusters' own sign flips: under H0 every cluster's antisymmetric part (n_ij - n_ji) is
    as likely to appear reversed, whatever the dependence inside the cluster; the pair totals n_ij + n_ji, the
    statistic's denominators, do not change under a flip. Exact enumeration with few non-symmetric clusters,
    seeded Monte Carlo otherwise. One item per cluster gives Bowker's exact conditional test."""
    t = np.asarray(tables, dtype=float)                     # [clusters, k, k]
    k = t.shape[1]
    iu = np.triu_indices(k, 1)
    a = (t - t.transpose(0, 2, 1))[:, iu[0], iu[1]]         # [clusters, pairs] antisymmetric parts
    m = (t + t.transpose(0, 2, 1))[:, iu[0], iu[1]].sum(0)  # pair totals
    used = m > 0
    if not used.any():
        return SymmetryResult(0.0, 0, 1.0, 1.0, "no off-diagonal counts")
    a, m = a[:, used], m[used]
    a = a[np.abs(a).sum(1) > 0]

    def stat(signs):
        return ((signs @ a) ** 2 / m).sum(-1)
    observed = float(stat(np.ones(a.shape[0])))
    df = len(iu[0])
    p_asym = float(sps.chi2.sf(observed, df))
    g = a.shape[0]
    if g == 0:
        return SymmetryResult(observed, df, p_asym, 1.0, "every cluster symmetric")
    if g <= exact_limit:
        p = float(np.mean(stat(_sign_patterns(g)) >= observed - 1e-9))
        method = f"exact over {2 ** g} sign patterns of {g} clusters"
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice([-1.0, 1.0], size=(n_mc, g))
        p = float((1 + np.sum(stat(signs) >= observed - 1e-9)) / (n_mc + 1))
        method = f"monte-carlo sign flips of {g} clusters ({n_mc}, seed {seed})"
    return SymmetryResult(observed, df, p_asym, min(1.0, p), method)


# ------------------------------------------------------------------------------------ exact bounds
@functools.lru_cache(maxsize=65536)
def cp_upper(k: int, n: int, alpha: float) -> float:
    """One-sided Clopper-Pearson (1 - alpha) upper bound of a binomial proportion with k of n.

    Cached: a pure function of counts that recur from comparison to comparison (each scipy call ~0.2 ms, four
    per comparison in `equivalence`)."""
    if n <= 0:
        return 1.0
    return 1.0 if k >= n else float(sps.beta.ppf(1 - alpha, k + 1, n - k))


def delta_upper(k_this: int, m: int, n: int, alpha: float) -> float:
    """Exact (1 - alpha) upper bound of a paired difference p_this - p_other, where k_this of the m
    discordant items (of n) fall on this side: delta = pd (2 pi - 1) with pd the discordant rate and pi the
    share of this side among discordant items, so with both bounded by one-sided Clopper-Pearson bounds at
    alpha / 2 (Bonferroni), delta <= U(pd) * max(0, 2 U(pi) - 1). It keeps the cancellation between the two
    directions (symmetric flips bound the difference near 0) and needs no normal approximation; with no
    discordant item it is 1 - (alpha / 2) ** (1 / n)."""
    return cp_upper(m, n, alpha / 2) * max(0.0, 2 * cp_upper(k_this, m, alpha / 2) - 1) if m else \
        cp_upper(0, n, alpha / 2)


@dataclass
class Equivalence:
    shown: bool
    exact_low: float     # exact (1 - 2 alpha) interval of the difference, from delta_upper both ways
    exact_high: float
    t_low: float         # cluster-robust (1 - 2 alpha) t interval of the difference
    t_high: float
    p: float             # TOST p of the cluster-robust interval (reported)


def equivalence(b: int, c: int, n: int, delta: float, se: float, df: int, margin: float,
                alpha: float) -> Equivalence:
    """Equivalence within +-margin of the paired accuracy difference (c - b) / n, shown by two intervals at
    once, each the TOST pair of one-sided bounds at alpha:
    - exact (delta_upper): valid for independent items at any count, including none (no normal
      approximation, no floor: with no discordant item it needs n >= log(alpha / 2) / log(1 - margin));
    - cluster-robust: the t interval with the cluster-robust SE (df = clusters - 1), valid when items are
      dependent within clusters (subjects, documents) and there are enough of them.
    Equivalence is shown when both lie inside +-margin, so the PASS rate at the boundary stays at or below
    alpha if either model of the data holds; requiring every configuration and task to PASS makes the
    sign-off an intersection-union test, which needs no multiplicity correction."""
    m = b + c
    hi, lo = delta_upper(c, m, n, alpha), delta_upper(b, m, n, alpha)
    t = tost(delta, se, margin, df=df, alpha=alpha)
    shown = hi < margin and lo < margin and t.ci_low > -margin and t.ci_high < margin
    return Equivalence(shown, -lo, hi, t.ci_low, t.ci_high, t.p)


@functools.lru_cache(maxsize=4096)
def planned_n(flip_rate: float, margin: float, alpha: float = 0.05, power: float = 0.8,
              n_max: int = 200_000) -> int | None:
    """Smallest n whose exact equivalence interval lies inside +-margin with probability >= power when the
    systems are equivalent (delta = 0) and a fraction ``flip_rate`` of items flips, half each way (the
    number of flips ~ Bin(n, flip_rate), each side ~ Bin(flips, 1/2)). None when above n_max."""
    q = 1 - alpha / 2

    def p_show(n):
        if flip_rate <= 0:
            return 1.0 if delta_upper(0, 0, n, alpha) < margin else 0.0
        lo_m, hi_m = (int(x) for x in sps.binom.ppf([1e-6, 1 - 1e-6], n, flip_rate))
        ms = np.arange(lo_m, hi_m + 1)
        u_pd = np.where(ms >= n, 1.0, sc.betaincinv(ms + 1, np.maximum(n - ms, 1), q))   # cp_upper(m, n)
        ks = np.arange(hi_m + 1)
        mm, kk = np.meshgrid(ms, ks, indexing="ij")                                     # [m, k]
        u_pi = np.where(kk >= mm, 1.0, sc.betaincinv(kk + 1, np.maximum(mm - kk, 1), q))  # cp_upper(k, m)
        ok = (u_pd[:, None] * np.maximum(0.0, 2 * u_pi - 1) < margin) | (mm == 0)        # side with k items
        other = np.where(kk <= mm, mm - kk, 0)                                          # ... and the m - k side
        both = ok & np.take_along_axis(ok, other, axis=1) & (kk <= mm)
        both[ms == 0] = u_pd[ms == 0, None] < margin
        w = sps.binom.pmf(kk, mm, 0.5) * both
        return float((sps.binom.pmf(ms, n, flip_rate) * w.sum(1)).sum())
    hi = 16
    while p_show(hi) < power:
        hi *= 2
        if hi > n_max:
            return None
    lo = hi // 2
    while lo < hi:
        mid = (lo + hi) // 2
        if p_show(mid) >= power:
            hi = mid
        else:
            lo = mid + 1
    return lo
