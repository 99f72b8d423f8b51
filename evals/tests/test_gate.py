"""Pairing and verdicts on synthetic per-sample records."""
from __future__ import annotations

import numpy as np
import pytest

from dpep_parity.evals import gate as G
from dpep_parity.evals.matrix import GateSettings


def mmlu_records(preds, golds, subjects=None, lls=None):
    out = []
    for i, (p, g) in enumerate(zip(preds, golds)):
        ll = lls[i] if lls is not None else [-2.0 + (0.5 if k == p else 0.0) for k in range(4)]
        out.append({"task": "mmlu", "doc_id": f"mmlu/s/{i}", "prompt_hash": f"h{i}",
                    "subject": subjects[i] if subjects else f"s{i % 7}", "gold": g, "pred": p, "lls": ll,
                    "metrics": {"acc": float(p == g)}})
    return out


def gsm_records(correct, gens=None):
    return [{"task": "gsm8k", "doc_id": f"gsm8k/{i}", "prompt_hash": f"g{i}", "subject": None,
             "generation": gens[i] if gens else "x", "metrics": {"flexible-extract": float(c),
                                                                  "strict-match": float(c)}}
            for i, c in enumerate(correct)]


def run(base, cfg, gate=None, task="mmlu"):
    gate = gate or GateSettings()
    c = G.compare(G.pair(task, base, cfg, "base", "cfg"), gate)
    G.decide([c], gate)
    return c


def test_pairing_refuses_different_prompts_and_documents():
    rng = np.random.default_rng(0)
    golds = rng.integers(0, 4, 50).tolist()
    base = mmlu_records(golds, golds)
    other = mmlu_records(golds, golds)
    other[7]["prompt_hash"] = "different"
    with pytest.raises(G.PairingError, match=r"prompts differ .* for 1 of 50 documents .*mmlu/s/7"):
        G.pair("mmlu", base, other, "base", "cfg")
    with pytest.raises(G.PairingError, match="ran different documents"):
        G.pair("mmlu", base, other[:-1], "base", "cfg")
    # order does not matter, ids do
    p = G.pair("mmlu", base, list(reversed(mmlu_records(golds, golds))))
    assert [r["doc_id"] for r in p.base] == [r["doc_id"] for r in p.cfg]


def test_identical_large_sample_passes():
    rng = np.random.default_rng(1)
    golds = rng.integers(0, 4, 2000).tolist()
    preds = [g if rng.random() < 0.6 else (g + 1) % 4 for g in golds]
    c = run(mmlu_records(preds, golds), mmlu_records(preds, golds))
    assert c["verdict"] == "PASS", c["reasons"]
    assert c["agreement"] == 1.0 and c["drift"]["max_abs_chosen"] == 0.0
    assert c["b_base_only"] == c["c_cfg_only"] == 0


def test_small_sample_is_inconclusive_and_says_what_would_decide():
    golds = [0, 1, 2, 3] * 10
    c = run(mmlu_records(golds, golds), mmlu_records(golds, golds))
    assert c["verdict"] == "INCONCLUSIVE"
    assert "not shown" in c["reasons"][0] and "about 368 items would show it" in c["reasons"][0]


def test_an_inconclusive_loss_beyond_the_margin_says_so_and_does_not_advise_more_items_for_equivalence():
    """10 items right only on the baseline, 3 only on the configuration, of 600: a 1.17-pt loss beyond the 1-pt
    margin that McNemar (p = 0.09) does not call significant. INCONCLUSIVE, and the reason says the data point
    away from equivalence instead of promising it at a larger size."""
    golds = [i % 4 for i in range(600)]
    wrong = lambda lo, hi: [(g + 1) % 4 if lo <= i < hi else g for i, g in enumerate(golds)]  # noqa: E731
    base, cfg = wrong(10, 13), wrong(0, 10)      # right only on the baseline: 0-9; only on the config: 10-12
    c = run(mmlu_records(base, golds), mmlu_records(cfg, golds))
    assert (c["b_base_only"], c["c_cfg_only"]) == (10, 3), (c["b_base_only"], c["c_cfg_only"])
    assert c["verdict"] == "INCONCLUSIVE", c["reasons"]
    why = c["reasons"][0]
    assert "the data point away from it" in why and "probable regression" in why and "would show it" not in why
    assert "<= delta <=" in why and "at or beyond 0 by construction" in why


def test_the_planned_drop_counts_its_own_discordance():
    """The pre-run power line: the detectable drop d solves d = k sqrt((r + d - d^2) / n) (a drop adds d of
    one-way flips), larger than the figure taken at the no-difference flip rate."""
    from dpep_parity.evals import stats
    n, r, a = 600, 0.01, 0.05 / 10
    d = stats.mdd_under_drop(n, r, a, 0.8)
    k = stats.mdd(1.0, a, 0.8)
    assert d == pytest.approx(k * np.sqrt((r + d - d * d) / n), rel=1e-9)
    assert d > stats.mdd(stats.planned_se(n, r), a, 0.8) * 1.5


def test_no_discordance_needs_the_exact_sample_size():
    """An exact bound, not a floor: with no discordant item n = 368 shows +-1 point, n = 367 does not."""
    for n, verdict in ((367, "INCONCLUSIVE"), (368, "PASS")):
        golds = [i % 4 for i in range(n)]
        c = run(gsm_records([1, 0] * (n // 2) + [1] * (n % 2)), gsm_records([1, 0] * (n // 2) + [1] * (n % 2)),
                GateSettings(margin=1.0), task="gsm8k")
        assert c["verdict"] == verdict, (n, c["reasons"])
        del golds


def test_accuracy_drop_fails_mcnemar():
    rng = np.random.default_rng(2)
    golds = rng.integers(0, 4, 1000).tolist()
    preds = [g if rng.random() < 0.6 else (g + 1) % 4 for g in golds]
    worse = [(p + 2) % 4 if (p == g and rng.random() < 0.1) else p for p, g in zip(preds, golds)]
    c = run(mmlu_records(preds, golds), mmlu_records(worse, golds))
    assert c["verdict"] == "FAIL"
    assert any("accuracy differs" in r and "sign-flip test over subjects" in r for r in c["reasons"])


def test_one_letter_bias_fails_symmetry_even_at_equal_accuracy():
    rng = np.random.default_rng(3)
    golds = rng.integers(0, 4, 400).tolist()
    preds = rng.integers(0, 4, 400).tolist()
    biased = [0 if rng.random() < 0.3 else p for p in preds]  # flips only towards "A"
    c = run(mmlu_records(preds, golds), mmlu_records(biased, golds))
    assert c["verdict"] == "FAIL"
    assert any("answers shift systematically" in r and "->A" in r for r in c["reasons"]), c["reasons"]


def test_symmetric_noise_flips_do_not_fail_on_their_own():
    rng = np.random.default_rng(4)
    golds = rng.integers(0, 4, 3000).tolist()
    preds = [g if rng.random() < 0.6 else int(rng.integers(0, 4)) for g in golds]
    noisy = list(preds)
    # 1% near-tie flips: as many right->wrong as wrong->right, in random letter directions
    right = [i for i, (p, g) in enumerate(zip(preds, golds)) if p == g]
    wrong = [i for i, (p, g) in enumerate(zip(preds, golds)) if p != g]
    for i in rng.choice(right, 15, replace=False):
        noisy[i] = (golds[i] + int(rng.integers(1, 4))) % 4
    for i in rng.choice(wrong, 15, replace=False):
        noisy[i] = golds[i]
    c = run(mmlu_records(preds, golds), mmlu_records(noisy, golds))
    assert c["symmetry"]["p"] > 0.05
    assert c["verdict"] in ("PASS", "INCONCLUSIVE")


def test_declared_limits_and_drift():
    golds = [0, 1, 2, 3] * 10
    base = mmlu_records(golds, golds)
    cfg = mmlu_records(golds, golds, lls=[[x * 2 for x in r["lls"]] for r in base])
    c = run(base, cfg, GateSettings(max_logprob_drift=0.1))
    assert c["verdict"] == "FAIL" and "log-likelihood drift" in c["reasons"][0]
    assert c["drift"]["mean_abs_chosen"] == pytest.approx(1.5)


def test_gsm8k_agreement_and_holm_over_family():
    base = gsm_records([1, 0] * 100, gens=[f"g{i}" for i in range(200)])
    cfg = gsm_records([1, 0] * 100, gens=[f"g{i}" if i % 10 else "other" for i in range(200)])
    gate = GateSettings()
    a = G.compare(G.pair("gsm8k", base, cfg), gate)
    b = G.compare(G.pair("gsm8k", base, cfg), gate)
    G.decide([a, b], gate)
    assert a["agreement"] == pytest.approx(0.9) and a["symmetry"] is None and a["drift"] is None
    assert a["p_diff_holm"] == 1.0 and a["diff_test"] == "exact McNemar test"


def test_aa_findings_flag_deterministic_disagreement():
    golds = [0, 1, 2, 3] * 10
    base = mmlu_records(golds, golds)
    other = mmlu_records([(g + 1) % 4 if i == 3 else g for i, g in enumerate(golds)], golds)
    c = G.compare(G.pair("mmlu", base, other), GateSettings(), kind="aa")
    notes = G.aa_findings([c], deterministic=True)
    assert "A/A DISAGREEMENT on a deterministic engine" in notes[0] and "1 of 40" in notes[0]
    assert "nondeterminism" in G.aa_findings([c], deterministic=False)[0]


def test_planned_sizes_grow_with_flips_and_mdd_with_the_family():
    gate = GateSettings()
    one = G.planned_sizes({"mmlu": 1000, "gsm8k": 200}, gate, n_configs=1)
    four = G.planned_sizes({"mmlu": 1000, "gsm8k": 200}, gate, n_configs=4)
    mm = one[0]
    assert mm["n_needed"]["0%"] == 368 and mm["n_needed"]["1%"] > mm["n_needed"]["0%"]
    assert one[1]["n_needed"]["0%"] == 183            # GSM8K's margin is 2 points
    assert four[0]["mdd"]["1%"] > one[0]["mdd"]["1%"] > 0   # Holm over 12 tests, not 3


@pytest.mark.slow
def test_clustered_flips_are_judged_by_clusters():
    """Every flip of one subject counts once in the difference test (its p-value comes from the subjects'
    signs), and flips that cancel within subjects are no evidence of a difference."""
    subjects = [f"s{i // 50}" for i in range(1000)]            # 20 subjects of 50 items
    golds = [i % 4 for i in range(1000)]
    preds = [g if i % 50 < 40 else (g + 1) % 4 for i, g in enumerate(golds)]   # 10 wrong per subject
    down, mixed = list(preds), list(preds)
    for i in range(0, 1000, 50):
        for j in (i, i + 1, i + 2):                            # 3 right -> wrong in every subject
            down[j] = mixed[j] = (golds[j] + 1) % 4
        for j in (i + 40, i + 41, i + 42):                     # ... and, in `mixed`, 3 wrong -> right
            mixed[j] = golds[j]
    c = run(mmlu_records(preds, golds, subjects), mmlu_records(down, golds, subjects))
    assert c["diff_test"].startswith("exact sign-flip test over subjects")
    assert c["b_base_only"] == 60 and c["c_cfg_only"] == 0
    # 20 subjects all one way: p = 2 / 2^20, a FAIL whatever the dependence of items within a subject
    assert c["p_diff"] == pytest.approx(2 / 2 ** 20) and c["verdict"] == "FAIL"
    c = run(mmlu_records(preds, golds, subjects), mmlu_records(mixed, golds, subjects))
    assert c["b_base_only"] == c["c_cfg_only"] == 60 and c["p_diff"] == 1.0 and c["verdict"] != "FAIL"
