"""The paired accuracy-parity gate: every configuration against the baseline, per task.

Verdict per (configuration, task), see docs/evals.md:
  FAIL          exact McNemar rejects (accuracy differs), or the answer-symmetry test rejects (answers
                shift towards one letter), both Holm-adjusted over the whole sign-off at ``alpha``;
                or a declared hard limit (min_agreement, max_logprob_drift) is broken;
                or equivalence within +-margin is not shown although the sample could show it.
  PASS          equivalence shown: TOST p < alpha (the 1-2*alpha CI of the difference is within +-margin).
  INCONCLUSIVE  equivalence not shown and the sample is too small to show it (smallest showable
                margin > margin); the report gives that margin and the MDD.
A configuration takes its worst task verdict; the sign-off its worst configuration verdict.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from evals import stats
from evals.matrix import GateSettings

LETTERS = "ABCD"
ORDER = {"PASS": 0, "INCONCLUSIVE": 1, "FAIL": 2}


class PairingError(ValueError):
    """Two runs cannot be paired: different documents or different prompts."""


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


def correct(rec: dict, gate: GateSettings) -> float:
    return rec["metrics"]["acc"] if rec["task"] == "mmlu" else rec["metrics"][gate.gsm8k_metric]


def compare(p: Paired, gate: GateSettings, kind: str = "config") -> dict:
    """All paired statistics of one configuration vs the baseline on one task (fractions)."""
    yb = np.array([correct(r, gate) for r in p.base])
    yc = np.array([correct(r, gate) for r in p.cfg])
    n = int(yb.size)
    clusters = [r["subject"] for r in p.base] if p.task == "mmlu" else None
    acc_b, se_b = stats.mean_se(yb, clusters)
    acc_c, se_c = stats.mean_se(yc, clusters)
    d = yc - yb
    delta, se_d = stats.mean_se(d, clusters)
    se_d = 0.0 if math.isnan(se_d) else se_d
    b = int(np.sum((yb == 1) & (yc == 0)))
    c = int(np.sum((yb == 0) & (yc == 1)))
    se_eq = max(se_d, stats.agresti_min_se(b, c, n))
    n_clusters = len(set(clusters)) if clusters else n
    df = max(n_clusters - 1, 1)
    t = stats.tost(delta, se_eq, gate.margin / 100, df=df, alpha=gate.alpha)
    lo, hi = stats.paired_bootstrap_ci(yb, yc, clusters, n_boot=gate.bootstrap, seed=gate.seed)
    out = {
        "kind": kind, "task": p.task, "config": p.cfg_name, "baseline": p.base_name, "n": n,
        "n_clusters": n_clusters if clusters else None,
        "acc_base": acc_b, "se_base": se_b, "acc_cfg": acc_c, "se_cfg": se_c,
        "se_kind": "cluster-robust by subject" if clusters else "iid",
        "delta": delta, "se_delta": se_d, "se_equivalence": se_eq,
        "ci95_bootstrap": [lo, hi], "b_base_only": b, "c_cfg_only": c, "p_mcnemar": stats.mcnemar_exact(b, c),
        "tost_p": t.p, "ci_tost": [t.ci_low, t.ci_high], "margin": gate.margin / 100,
        "mdd": stats.mdd(se_eq, gate.alpha, gate.power),
        "equivalence_mdd": stats.equivalence_mdd(se_eq, gate.alpha, gate.power),
        "symmetry": None, "drift": None,
    }
    if p.task == "mmlu":
        pb = [r["pred"] for r in p.base]
        pc = [r["pred"] for r in p.cfg]
        table = np.zeros((4, 4), dtype=int)
        for i, j in zip(pb, pc):
            table[i, j] += 1
        sym = stats.bowker_symmetry(table, seed=gate.seed)
        flips = Counter((LETTERS[i], LETTERS[j]) for i, j in zip(pb, pc) if i != j)
        out["symmetry"] = {"statistic": sym.statistic, "df": sym.df, "p": sym.p_exact,
                           "p_chi2": sym.p_asymptotic, "method": sym.method, "table": table.tolist(),
                           "top_flips": [[f"{x}->{y}", k] for (x, y), k in flips.most_common(3)]}
        out["agreement"] = float(np.mean(np.array(pb) == np.array(pc)))
        pairs = list(zip(p.base, p.cfg, strict=True))
        chosen = np.array([abs(rc["lls"][rb["pred"]] - rb["lls"][rb["pred"]]) for rb, rc in pairs])
        every = np.array([max(abs(x - y) for x, y in zip(rb["lls"], rc["lls"], strict=True))
                          for rb, rc in pairs])
        out["drift"] = {"mean_abs_chosen": float(chosen.mean()), "max_abs_chosen": float(chosen.max()),
                        "max_abs_any_choice": float(every.max())}
        out["agreement_what"] = "same answer letter"
    else:
        same = [rb["generation"] == rc["generation"] for rb, rc in zip(p.base, p.cfg, strict=True)]
        out["agreement"] = float(np.mean(same))
        out["agreement_what"] = "identical greedy generation"
    out["n_disagree"] = round((1 - out["agreement"]) * n)
    return out


def _pts(x: float) -> str:
    return f"{100 * x:.2f}"


def decide(comparisons: list[dict], gate: GateSettings) -> None:
    """Holm-adjust the rejection tests over the sign-off and set each comparison's verdict."""
    family = [(i, key) for i, c in enumerate(comparisons) if c["kind"] == "config"
              for key in ("p_mcnemar", "symmetry") if key == "p_mcnemar" or c["symmetry"]]
    raw = [comparisons[i]["p_mcnemar"] if key == "p_mcnemar" else comparisons[i]["symmetry"]["p"]
           for i, key in family]
    adjusted = stats.holm(raw)
    for c in comparisons:
        c["p_mcnemar_holm"] = c["p_mcnemar"] if c["kind"] != "config" else None
        if c["symmetry"]:
            c["symmetry"]["p_holm"] = c["symmetry"]["p"] if c["kind"] != "config" else None
    for (i, key), adj in zip(family, adjusted):
        if key == "p_mcnemar":
            comparisons[i]["p_mcnemar_holm"] = adj
        else:
            comparisons[i]["symmetry"]["p_holm"] = adj
    for c in comparisons:
        _verdict(c, gate, n_tests=len(raw))


def _verdict(c: dict, gate: GateSettings, n_tests: int) -> None:
    a, m = gate.alpha, c["margin"]
    fail, why = [], []
    if c["p_mcnemar_holm"] < a:
        fail.append(f"accuracy differs: {c['b_base_only']} items right only on the baseline vs "
                    f"{c['c_cfg_only']} only on {c['config']!r} (exact McNemar p={c['p_mcnemar']:.2g}, "
                    f"Holm-adjusted over {n_tests} tests p={c['p_mcnemar_holm']:.2g} < {a})")
    sym = c["symmetry"]
    if sym and sym["p_holm"] < a:
        flips = ", ".join(f"{f} x{k}" for f, k in sym["top_flips"])
        fail.append(f"answers shift systematically ({flips}): exact symmetry test p={sym['p']:.2g}, "
                    f"Holm-adjusted p={sym['p_holm']:.2g} < {a}")
    if gate.min_agreement is not None and c["agreement"] < gate.min_agreement:
        fail.append(f"agreement {100 * c['agreement']:.1f}% ({c['agreement_what']}) is below the "
                    f"declared floor {100 * gate.min_agreement:.1f}%")
    drift = c["drift"]["mean_abs_chosen"] if c["drift"] else None
    if gate.max_logprob_drift is not None and drift is not None and drift > gate.max_logprob_drift:
        fail.append(f"log-likelihood drift {drift:.3g} nats (mean |delta| of the chosen "
                    f"answer) exceeds the declared ceiling {gate.max_logprob_drift:.3g}")
    lo, hi = c["ci_tost"]
    ci = f"{100 * (1 - 2 * a):.0f}% CI of the difference [{_pts(lo)}, {_pts(hi)}] pts"
    if fail:
        verdict = "FAIL"
    elif c["tost_p"] < a:
        verdict = "PASS"
        why.append(f"equivalent within +-{_pts(m)} pts: {ci} (TOST p={c['tost_p']:.2g})")
    elif c["equivalence_mdd"] > m:
        verdict = "INCONCLUSIVE"
        why.append(f"sample too small to show equivalence within +-{_pts(m)} pts: the smallest margin "
                   f"n={c['n']} can show is {_pts(c['equivalence_mdd'])} pts (MDD {_pts(c['mdd'])} pts); "
                   f"{ci}")
    else:
        verdict = "FAIL"
        fail.append(f"equivalence within +-{_pts(m)} pts not shown although the sample could show "
                    f"{_pts(c['equivalence_mdd'])} pts: {ci} (TOST p={c['tost_p']:.2g})")
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
        what = (f"{c['n_disagree']} of {c['n']} items differ ({c['agreement_what']}), {flips} correctness "
                f"flips, max |delta logprob| {drift:.3g}")
        if differs and deterministic:
            notes.append(f"A/A DISAGREEMENT on a deterministic engine ({c['task']}): {what}")
        elif differs:
            notes.append(f"A/A nondeterminism ({c['task']}): {what}")
        else:
            notes.append(f"A/A identical ({c['task']}, {c['n']} items, bitwise-equal log-probabilities)"
                         if c["drift"] else f"A/A identical ({c['task']}, {c['n']} items)")
    return notes


def planned_power(n_by_task: dict[str, int], gate: GateSettings, flip_rates=(0.01, 0.05, 0.2)) -> list[dict]:
    """MDD per task before the run, for assumed rates of discordant (flipped) items."""
    rows = []
    for task, n in n_by_task.items():
        row = {"task": task, "n": n,
               "mdd": {f"{int(r * 100)}%": stats.mdd(stats.planned_se(n, r), gate.alpha, gate.power)
                       for r in flip_rates},
               "smallest_margin_zero_flips": stats.equivalence_mdd(stats.agresti_min_se(0, 0, n),
                                                                   gate.alpha, gate.power)}
        rows.append(row)
    return rows
