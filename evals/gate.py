"""The paired accuracy-parity gate: every configuration against the baseline, per measure.

Measures (each a paired binary outcome per unit, units grouped in clusters) belong to the eval tasks
(evals/tasks/<task>.py, a `Measure` each: which records' outcome, unit, cluster, default margin); the
statistics here are the same for all. The shipped ones:
  mmlu        per item: the answer is right; clusters: subjects.
  gsm8k       per item: the extracted answer is right (gate.gsm8k_metric); items independent.
  gsm8k-gold  per token of the reference solution, fed by teacher forcing after the prompt (served by decode
              steps in the in-process engine): the token was the greedy choice; clusters: documents.
              Only when both runs recorded it (in-process engines). With a half-precision in-process
              baseline the sign-off also serves the baseline in float64 (the truth run), and the tolerance
              test (`error_test`) asks whether the configuration's reference-token log-probabilities stray
              further from the truth than the tolerance model allows: FACTOR (2) times the baseline's own
              error in the same dtype, pooled over documents. It sees faults that change outputs without
              changing the random fixture's accuracy (a decode step reading another rank's rows).

Verdict per (configuration, measure), see docs/evals.md:
  FAIL          a test of the error-controlled family rejects at alpha after Holm's correction over every
                configuration and measure of the sign-off: the difference test (exact sign-flip test of the
                clusters' summed differences: exact McNemar when units are independent) or, for MMLU, the
                answer-symmetry test (Bowker's statistic, cluster sign-flip p-value; measures with answer
                letters), or the tolerance test against the float64 truth (measures marked `tolerance`); or a declared hard
                limit (min_agreement, max_logprob_drift) is broken.
  PASS          no FAIL, and equivalence within +-margin is shown by both the exact interval and the
                cluster-robust t interval of the difference (stats.equivalence).
  INCONCLUSIVE  neither: the report says how many units the observed flip rate would need.
A configuration takes its worst measure verdict; the sign-off its worst configuration verdict.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from dpep_parity.checks.core.numerics import FACTOR
from dpep_parity.evals import stats, tasks
from dpep_parity.evals.matrix import GateSettings
from dpep_parity.evals.tasks.base import PairingError  # noqa: F401  (re-exported: the gate raises it)

LETTERS = "ABCD"
ORDER = {"PASS": 0, "INCONCLUSIVE": 1, "FAIL": 2}
MEASURES = tuple(tasks.measures())   # the registered tasks' measures (evals/tasks/), in task order


@dataclass
class Paired:
    task: str
    base_name: str
    cfg_name: str
    base: list[dict]
    cfg: list[dict]


def pair(task: str, base_records: list[dict], cfg_records: list[dict], base_name: str = "baseline",
         cfg_name: str = "config") -> Paired:
    """Align by document id; refuse when documents or prompt hashes differ."""
    b = {r["doc_id"]: r for r in base_records}
    c = {r["doc_id"]: r for r in cfg_records}
    if len(b) != len(base_records) or len(c) != len(cfg_records):
        raise PairingError(f"{task}: duplicate document ids in the per-sample results")
    only_b, only_c = sorted(set(b) - set(c)), sorted(set(c) - set(b))
    if only_b or only_c:
        raise PairingError(
            f"{task}: {cfg_name!r} and {base_name!r} ran different documents "
            f"({len(only_b)} only in {base_name!r}, e.g. {only_b[:2]}; {len(only_c)} only in {cfg_name!r}, "
            f"e.g. {only_c[:2]}); rerun both on the same subset (same limits and --seed)")
    differ = [d for d in b if b[d]["prompt_hash"] != c[d]["prompt_hash"]]
    if differ:
        d = differ[0]
        raise PairingError(
            f"{task}: prompts differ between {base_name!r} and {cfg_name!r} for {len(differ)} of "
            f"{len(b)} documents (e.g. {d}: sha256 {b[d]['prompt_hash'][:12]} vs "
            f"{c[d]['prompt_hash'][:12]}); "
            "they were built from different data, task definitions or generation settings and cannot "
            "be compared")
    ids = sorted(b)
    return Paired(task, base_name, cfg_name, [b[i] for i in ids], [c[i] for i in ids])


def measures_of(task: str, p: Paired) -> list[str]:
    """The measures a task's paired records support (the task object decides)."""
    return tasks.get(task).measures_of(p)


def outcomes(p: Paired, measure: str, gate: GateSettings):
    """(baseline outcomes, configuration outcomes, cluster of each unit) as arrays (the measure decides)."""
    return tasks.measure(measure).outcomes(p, gate)


def token_errors(p: Paired, truth: dict[str, dict]) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Per document, the baseline's and the configuration's reference-token errors |log p - log p_truth|
    against the float64 truth run, and the document ids."""
    eb, ec, docs = [], [], []
    for rb, rc in zip(p.base, p.cfg, strict=True):
        t = truth.get(rb["doc_id"])
        if t is None or t["prompt_hash"] != rb["prompt_hash"] or len(t["gold_logprob"]) != len(rb["gold_logprob"]):
            raise PairingError(f"gsm8k-gold: the float64 truth run has no matching reference tokens for "
                               f"{rb['doc_id']} (a cache from other data or settings); delete its cache and rerun")
        tt = np.asarray(t["gold_logprob"], dtype=float)
        eb.append(np.abs(np.asarray(rb["gold_logprob"], dtype=float) - tt))
        ec.append(np.abs(np.asarray(rc["gold_logprob"], dtype=float) - tt))
        docs.append(rb["doc_id"])
    return eb, ec, docs


def error_test(p: Paired, truth: dict[str, dict], gate: GateSettings) -> dict:
    """The tolerance model (checks.core.numerics) on served outputs: per reference token, the error of its
    log-probability against the float64 truth, for the configuration (e_c) and for the baseline in the same
    dtype (e_b). A correct layout computes the same function in another order, so its errors have the size of
    the baseline's; the tolerance model allows FACTOR (2) times. H0: mean e_c <= FACTOR * mean e_b, tested on
    the documents' sums of e_c - FACTOR * e_b (documents are the clusters: a wrong step corrupts the K/V of
    every later token of its request) with a one-sided sign-flip test. Measured on the default fixture in
    bfloat16 (docs/evals.md, "The tolerance test"): correct layouts 1.00-1.07x; catalog mutant M08 (the MoE
    output reduced twice in idle-rank decode steps) 1.76x, inside the bound.

    A fault confined to some tokens barely moves that mean; the tail test (`stats.tail_signflip`, in
    `tail`) asks whether the configuration's errors, divided by FACTOR, own more of the pooled largest errors
    than a rerun of the baseline would, at every tail size, with the documents' sign flips: a run's own
    router near-tie flips (heavy-tailed, as likely in either run) cannot drive it. Both tests join the Holm
    family. `beyond` (tokens erring more than FACTOR times the baseline's largest error) is reported only:
    an extreme-value comparison whose level is not controlled (docs/evals.md)."""
    eb, ec, docs = token_errors(p, truth)
    sums = [float((c - FACTOR * b).sum()) for b, c in zip(eb, ec)]
    eb_all, ec_all = (np.concatenate(x) if x else np.zeros(0) for x in (eb, ec))
    mb, mc = (float(x.mean()) if x.size else 0.0 for x in (eb_all, ec_all))
    ratio = mc / mb if mb > 0 else (math.inf if mc > 0 else 1.0)
    largest_b = float(eb_all.max()) if eb_all.size else 0.0
    worst = int(np.argmax(sums)) if sums else None
    peak = int(np.argmax([x.max() if x.size else 0.0 for x in ec])) if ec else None
    tail = stats.tail_signflip(eb, [c / FACTOR for c in ec], gate.symmetry_draws, gate.seed)
    return {
        "factor": FACTOR, "err_base": mb, "err_cfg": mc, "ratio": ratio,
        "max_base": largest_b, "max_cfg": float(ec_all.max()) if ec_all.size else 0.0,
        "beyond": int(np.sum(ec_all > FACTOR * largest_b)),
        "worst_doc": docs[worst] if worst is not None and sums[worst] > 0 else None,
        "peak_doc": docs[peak] if peak is not None else None,
        "p": stats.signflip_greater(sums, gate.symmetry_draws, gate.seed),
        "method": f"one-sided sign-flip test over {len(sums)} documents",
        "tail": {"p": tail.p, "size": tail.size, "cfg_tokens": tail.cfg, "base_tokens": tail.base,
                 "statistic": tail.statistic,
                 "worst_doc": docs[tail.worst_cluster] if tail.worst_cluster is not None else None,
                 "method": f"tail sign-flip test over {len(docs)} documents (tails of 1, 2, 4, ... pooled tokens)"},
    }


def _cluster_index(cl) -> np.ndarray:
    """Each unit's cluster as an index into the sorted distinct labels, `np.unique(cl, return_inverse=True)[1]`.
    Paired records come in document-id order, so a measure's labels usually arrive sorted already (a document's
    reference tokens together; MMLU's subjects, whose ids start with the subject): then the index is the running
    count of label changes, one pass instead of a sort (~4 ms for gsm8k-gold's 40,000 string labels)."""
    cl = np.asarray(cl)
    if cl.dtype.kind in "USiu" and cl.size > 1 and bool(np.all(cl[1:] >= cl[:-1])):
        return np.concatenate(([0], np.cumsum(cl[1:] != cl[:-1])))
    return np.unique(cl, return_inverse=True)[1]


def compare(p: Paired, gate: GateSettings, kind: str = "config", measure: str | None = None,
            truth: dict[str, dict] | None = None) -> dict:
    """All paired statistics of one configuration vs the baseline on one measure (fractions). `truth`: the
    float64 truth run's records of the measure by document id, for the tolerance test (measures marked
    `tolerance`: gsm8k-gold)."""
    measure = measure or p.task
    m = tasks.measure(measure)
    yb, yc, cl = outcomes(p, measure, gate)
    n = int(yb.size)
    inv = _cluster_index(cl) if n else np.zeros(0, dtype=int)
    n_clusters = int(inv.max()) + 1 if n else 0
    clustered = n_clusters < n
    clusters = cl if clustered else None
    # the cluster index computed above, not sorted again per mean (40,000 string labels for gsm8k-gold)
    acc_b, se_b = stats.mean_se(yb, clusters, inverse=inv)
    acc_c, se_c = stats.mean_se(yc, clusters, inverse=inv)
    d = yc - yb
    delta, se_d = stats.mean_se(d, clusters, inverse=inv)
    se_d = 0.0 if math.isnan(se_d) else se_d
    b = int(np.sum((yb == 1) & (yc == 0)))
    c = int(np.sum((yb == 0) & (yc == 1)))
    cluster_sums = np.bincount(inv, weights=d, minlength=n_clusters).round().astype(np.int64) if n else []
    margin = gate.margin_for(measure) / 100
    eq = stats.equivalence(b, c, n, delta, se_d, max(n_clusters - 1, 1), margin, gate.alpha)
    lo, hi = stats.paired_bootstrap_ci(yb, yc, clusters, n_boot=gate.bootstrap, seed=gate.seed)
    agreement, agreement_what = m.agreement(p)
    out = {
        "kind": kind, "task": measure, "config": p.cfg_name, "baseline": p.base_name, "n": n,
        "unit": m.unit,
        "n_clusters": n_clusters if clustered else None,
        "acc_base": acc_b, "se_base": se_b, "acc_cfg": acc_c, "se_cfg": se_c,
        "se_kind": f"cluster-robust by {m.cluster}" if m.cluster else "iid",
        "delta": delta, "se_delta": se_d, "ci95_bootstrap": [lo, hi], "b_base_only": b, "c_cfg_only": c,
        "p_diff": stats.signflip_test(cluster_sums),
        "diff_test": f"exact sign-flip test over {m.cluster or 'document'}s" if clustered else "exact McNemar test",
        "equivalence": {"shown": eq.shown, "exact": [eq.exact_low, eq.exact_high], "t": [eq.t_low, eq.t_high],
                        "p_t": eq.p},
        "margin": margin, "symmetry": None, "drift": m.drift(p), "error": None,
        "agreement": agreement, "agreement_what": agreement_what,
    }
    if m.answers is not None:
        pb, pc = m.answers(p)
        tables = np.zeros((n_clusters, 4, 4), dtype=int)
        np.add.at(tables, (inv, np.asarray(pb, dtype=int), np.asarray(pc, dtype=int)), 1)   # count per unit
        sym = stats.cluster_symmetry(tables, n_mc=gate.symmetry_draws, seed=gate.seed)
        flips = Counter((LETTERS[i], LETTERS[j]) for i, j in zip(pb, pc) if i != j)
        out["symmetry"] = {"statistic": sym.statistic, "df": sym.df, "p": sym.p_exact,
                           "p_chi2": sym.p_asymptotic, "method": sym.method, "table": tables.sum(0).tolist(),
                           "top_flips": [[f"{x}->{y}", k] for (x, y), k in flips.most_common(3)]}
    if m.tolerance and truth is not None:
        out["error"] = error_test(p, truth, gate)
    out["n_disagree"] = round((1 - out["agreement"]) * n)
    return out


def _pts(x: float) -> str:
    return f"{100 * x:.2f}"


TESTS = ("p_diff", "symmetry", "error", "tail")   # the difference test; the symmetry test (answer letters:
#                                                   MMLU); the tolerance test's pooled and tail tests (gsm8k-gold)


def _test(c: dict, key: str) -> dict | None:
    """The record of one of a comparison's tests other than the difference test (its `p`, its `p_holm`)."""
    if key == "tail":
        return (c.get("error") or {}).get("tail")
    return c.get(key)


def family(comparisons: list[dict]) -> list[tuple[int, str]]:
    """The error-controlled family: the difference test of every configuration comparison, the symmetry test
    of every one with answer letters (MMLU) and the tolerance test's pooled and tail tests of every one with a
    truth run (gsm8k-gold). A/A comparisons are diagnostics, not in it."""
    return [(i, key) for i, c in enumerate(comparisons) if c["kind"] == "config"
            for key in TESTS if key == "p_diff" or _test(c, key)]


def decide(comparisons: list[dict], gate: GateSettings) -> None:
    """Holm-adjust the family over the sign-off and set each comparison's verdict."""
    fam = family(comparisons)
    raw = [comparisons[i]["p_diff"] if key == "p_diff" else _test(comparisons[i], key)["p"] for i, key in fam]
    adjusted = stats.holm(raw)
    for c in comparisons:
        c["p_diff_holm"] = c["p_diff"] if c["kind"] != "config" else None
        for key in TESTS[1:]:
            if _test(c, key):
                _test(c, key)["p_holm"] = _test(c, key)["p"] if c["kind"] != "config" else None
    for (i, key), adj in zip(fam, adjusted):
        if key == "p_diff":
            comparisons[i]["p_diff_holm"] = adj
        else:
            _test(comparisons[i], key)["p_holm"] = adj
    for c in comparisons:
        c["n_tests"] = len(raw)
        c["mdd"] = stats.mdd(max(c["se_delta"], stats.agresti_min_se(c["b_base_only"], c["c_cfg_only"], c["n"])),
                             gate.alpha / max(len(raw), 1), gate.power)
        _verdict(c, gate)


def _verdict(c: dict, gate: GateSettings) -> None:
    a, m, n_tests = gate.alpha, c["margin"], c["n_tests"]
    fail, why = [], []
    if c["p_diff_holm"] < a:
        inside = abs(c["delta"]) < m
        fail.append(f"accuracy differs: {c['b_base_only']} {c['unit']}s right only on the baseline vs "
                    f"{c['c_cfg_only']} only on {c['config']!r}, delta {_pts(c['delta'])} pts ({c['diff_test']} "
                    f"p={c['p_diff']:.2g}, Holm-adjusted over {n_tests} tests p={c['p_diff_holm']:.2g} < {a})"
                    + (f"; a systematic difference, smaller than the +-{_pts(m)} pts margin: the layouts do "
                       "not compute the same function" if inside else ""))
    sym = c["symmetry"]
    if sym and sym["p_holm"] < a:
        flips = ", ".join(f"{f} x{k}" for f, k in sym["top_flips"])
        fail.append(f"answers shift systematically ({flips}): symmetry test p={sym['p']:.2g} ({sym['method']}), "
                    f"Holm-adjusted p={sym['p_holm']:.2g} < {a}")
    err = c.get("error")
    if err:
        what = (f"reference-token log-probabilities lie {err['ratio']:.2f}x as far from the float64 truth as "
                f"the baseline's in the same dtype (mean error {err['err_cfg']:.3g} vs {err['err_base']:.3g} "
                f"nats; the tolerance model allows {err['factor']:g}x; {err['beyond']} tokens beyond "
                f"{err['factor']:g}x the baseline's largest error {err['max_base']:.3g}")
        failed_before = len(fail)
        if err["p_holm"] < a:
            fail.append(f"{what}, worst document {err['worst_doc']}): a computation fault, not rounding "
                        f"({err['method']} p={err['p']:.2g}, Holm-adjusted p={err['p_holm']:.2g} < {a})")
        tail = err["tail"]
        if tail["p_holm"] < a:
            fail.append(f"the configuration's errors, divided by {err['factor']:g}, own {tail['cfg_tokens']} of "
                        f"the {tail['cfg_tokens'] + tail['base_tokens']} largest pooled reference-token errors "
                        f"(a tail of {tail['size']}) against the baseline's {tail['base_tokens']}; most in "
                        f"document {tail['worst_doc']}; largest {err['max_cfg']:.3g} nats in document "
                        f"{err['peak_doc']}: a computation fault ({tail['method']} p={tail['p']:.2g}, "
                        f"Holm-adjusted p={tail['p_holm']:.2g} < {a})")
        if len(fail) == failed_before:
            why.append(f"within the tolerance model: {what})")
    if gate.min_agreement is not None and c["agreement"] < gate.min_agreement:
        fail.append(f"agreement {100 * c['agreement']:.1f}% ({c['agreement_what']}) is below the "
                    f"declared floor {100 * gate.min_agreement:.1f}%")
    drift = c["drift"]["mean_abs_chosen"] if c["drift"] else None
    if gate.max_logprob_drift is not None and drift is not None and drift > gate.max_logprob_drift:
        fail.append(f"log-likelihood drift {drift:.3g} nats (mean |delta| of the chosen "
                    f"answer) exceeds the declared ceiling {gate.max_logprob_drift:.3g}")
    eq = c["equivalence"]
    level = f"{100 * (1 - 2 * a):.0f}%"
    # the exact bounds are one-sided bounds that never cross 0 (stats.delta_upper): they bound the difference
    # from each side, they do not locate it; printed as what they are, not as an interval around the estimate
    ci = (f"{level} exact bounds {_pts(eq['exact'][0])} <= delta <= {_pts(eq['exact'][1])} pts (each bound "
          f"at or beyond 0 by construction), {'cluster-robust' if c['n_clusters'] else 't'} interval "
          f"[{_pts(eq['t'][0])}, {_pts(eq['t'][1])}] pts")
    if fail:
        verdict = "FAIL"
        why = []
    elif eq["shown"]:
        verdict = "PASS"
        why.append(f"equivalent within +-{_pts(m)} pts: {ci}")
    else:
        verdict = "INCONCLUSIVE"
        rate = (c["b_base_only"] + c["c_cfg_only"]) / max(c["n"], 1)
        lo_t, hi_t = eq["t"]
        if hi_t < -m or lo_t > m or abs(c["delta"]) >= m:
            # the data lie at or beyond the margin: sample sizes planned for "no difference" do not apply
            side = "below" if c["delta"] < 0 else "above"
            where = (f"the {'cluster-robust' if c['n_clusters'] else 't'} interval lies entirely {side} "
                     f"{'-' if side == 'below' else '+'}{_pts(m)} pts" if hi_t < -m or lo_t > m else
                     f"the observed difference {_pts(c['delta'])} pts is at or beyond the margin")
            why.append(f"equivalence within +-{_pts(m)} pts not shown, and the data point away from it: {ci}; "
                       f"{where}. The difference test did not reach significance after Holm's correction "
                       f"(p={c['p_diff_holm']:.2g}), so this is not a FAIL, but more {c['unit']}s would more "
                       f"likely show a difference than equivalence: treat as a probable regression and "
                       f"investigate {c['config']!r}")
        else:
            need = stats.planned_n(rate, m, a, gate.power)
            why.append(f"equivalence within +-{_pts(m)} pts not shown: {ci}; at the observed flip rate "
                       f"{100 * rate:.2f}% about " + (f"{need} {c['unit']}s" if need else "more units than planned")
                       + f" would show it with probability {gate.power:.0%} if there were no difference, this "
                       f"run has {c['n']}")
    c["verdict"] = verdict
    c["reasons"] = fail + why


def worst(verdicts) -> str:
    verdicts = list(verdicts)
    return max(verdicts, key=ORDER.__getitem__) if verdicts else "PASS"


def aa_findings(aa: list[dict], deterministic: bool) -> list[str]:
    """What the A/A rerun of the baseline says about the engine's own nondeterminism."""
    notes = []
    for c in aa:
        drift = c["drift"]["max_abs_any_choice"] if c["drift"] else 0.0
        flips = c["b_base_only"] + c["c_cfg_only"]
        differs = c["agreement"] < 1 or flips > 0 or drift > 0
        what = (f"{c['n_disagree']} of {c['n']} {c['unit']}s differ ({c['agreement_what']}), {flips} correctness "
                f"flips, max |delta logprob| {drift:.3g}")
        if differs and deterministic:
            notes.append(f"A/A DISAGREEMENT on a deterministic engine ({c['task']}): {what}")
        elif differs:
            notes.append(f"A/A nondeterminism ({c['task']}): {what}")
        else:
            notes.append(f"A/A identical ({c['task']}, {c['n']} {c['unit']}s, bitwise-equal log-probabilities)"
                         if c["drift"] else f"A/A identical ({c['task']}, {c['n']} {c['unit']}s)")
    return notes


def planned_sizes(n_by_task: dict[str, int], gate: GateSettings, n_configs: int,
                  flip_rates=(0.0, 0.01, 0.05), tests_per_task: dict[str, int] | None = None) -> list[dict]:
    """Before the run, per task: the items needed for PASS with probability gate.power at assumed flip rates
    (stats.planned_n, exact interval), and the MDD of the difference test at those rates with Holm's
    correction (its first step: alpha / family size, the family counting every configuration's tests: per task,
    `tests_per_task`, default each task's `tests` without gsm8k-gold and truth run)."""
    per = {t: tasks.get(t).tests(in_process=False, truth=False) for t in n_by_task} | (tests_per_task or {})
    tests = n_configs * sum(per.get(t, 1) for t in n_by_task)
    rows = []
    for task, n in n_by_task.items():
        m = gate.margin_for(task) / 100
        rows.append({
            "task": task, "n": n, "margin": m, "family": tests,
            "n_needed": {f"{100 * r:g}%": stats.planned_n(r, m, gate.alpha, gate.power) for r in flip_rates},
            # the drop d detectable with gate.power, under the alternative itself: discordance flip rate + d
            "mdd": {f"{100 * r:g}%": stats.mdd_under_drop(n, r, gate.alpha / max(tests, 1), gate.power)
                    for r in flip_rates if r > 0},
        })
    return rows
