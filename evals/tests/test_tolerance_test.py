"""The tolerance test of gsm8k-gold (gate.error_test): served reference-token log-probabilities against the
float64 truth, the configuration's error against FACTOR times the baseline's in the same dtype: pooled over
documents (a one-sided sign-flip test of the mean) and per token (the largest baseline error times FACTOR).

Synthetic records first (noise of a known size), then the one-sided sign-flip test it rests on.
Negative controls: errors inflated 3x on every token (a precision-class fault), and a few documents corrupted
from some decode step on (a step that reads another rank's rows). Positive controls: another draw of the same
rounding noise (another reduction order), 1.5x the noise (a layout's own partial-sum roundings), and a config
in a wider dtype (smaller errors).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dpep_parity.evals import gate as G
from dpep_parity.evals import stats
from dpep_parity.evals.matrix import GateSettings

NOISE = 0.008   # nats: the mean reference-token error of the default fixture in bfloat16 (docs/evals.md)


def gold_records(logprobs, prefix="g"):
    return [{"task": "gsm8k", "doc_id": f"gsm8k/{i}", "prompt_hash": f"{prefix}{i}", "subject": None,
             "generation": "x", "metrics": {"flexible-extract": 0.0, "strict-match": 0.0},
             "gold_greedy": [False] * len(lp), "gold_logprob": [float(x) for x in lp]}
            for i, lp in enumerate(logprobs)]


def truth_and_base(rng, docs=200, tokens=50):
    truth = [rng.normal(-6.0, 2.0, tokens) for _ in range(docs)]
    base = [t + rng.normal(0, NOISE, tokens) for t in truth]
    return truth, base


def judge(truth, base, cfg, gate=None):
    gate = gate or GateSettings(bootstrap=0, symmetry_draws=5000)
    t = {r["doc_id"]: r for r in gold_records(truth)}
    p = G.pair("gsm8k", gold_records(base), gold_records(cfg), "base", "cfg")
    c = G.compare(p, gate, "config", "gsm8k-gold", truth=t)
    G.decide([c], gate)
    return c


def test_a_precision_fault_fails_with_its_ratio_and_bound():
    rng = np.random.default_rng(0)
    truth, base = truth_and_base(rng)
    cfg = [t + rng.normal(0, 3 * NOISE, t.size) for t in truth]
    c = judge(truth, base, cfg)
    assert c["verdict"] == "FAIL"
    assert 2.6 < c["error"]["ratio"] < 3.4 and c["error"]["p_holm"] < 0.05
    why = " ".join(c["reasons"])
    assert "x as far from the float64 truth" in why and "the tolerance model allows 2x" in why
    assert "a computation fault" in why


def test_a_few_corrupted_documents_fail_and_are_named():
    rng = np.random.default_rng(1)
    truth, base = truth_and_base(rng)
    cfg = [t + rng.normal(0, NOISE, t.size) for t in truth]
    for d in (3, 77, 150):                      # from token 20 on, a wrong hidden state: O(1) nats off
        cfg[d][20:] += rng.normal(0, 1.0, cfg[d].size - 20)
    c = judge(truth, base, cfg)
    assert c["verdict"] == "FAIL", c["reasons"]
    assert c["error"]["p_holm"] > 0.05        # 3 documents of 200: the pooled mean cannot see them ...
    assert c["error"]["beyond"] > 50          # ... the per-token bound does
    assert c["error"]["peak_doc"] in {"gsm8k/3", "gsm8k/77", "gsm8k/150"}
    assert any("per-token bound" in r and c["error"]["peak_doc"] in r for r in c["reasons"])


@pytest.mark.parametrize("scale", [1.0, 1.5, 0.01], ids=["other-order", "partial-sum-roundings", "wider-dtype"])
def test_legitimate_errors_pass_the_tolerance_test(scale):
    rng = np.random.default_rng(2)
    truth, base = truth_and_base(rng)
    cfg = [t + rng.normal(0, scale * NOISE, t.size) for t in truth]
    c = judge(truth, base, cfg)
    assert c["error"]["p_holm"] > 0.05 and c["error"]["beyond"] == 0
    assert not any("a computation fault" in r for r in c["reasons"])
    assert any("within the tolerance model" in r for r in c["reasons"])


def test_truth_from_other_documents_is_refused():
    rng = np.random.default_rng(3)
    truth, base = truth_and_base(rng, docs=5)
    t = {r["doc_id"]: r for r in gold_records(truth, prefix="other")}
    p = G.pair("gsm8k", gold_records(base), gold_records(base), "base", "cfg")
    with pytest.raises(G.PairingError, match="truth run has no matching reference tokens"):
        G.compare(p, GateSettings(bootstrap=0), "config", "gsm8k-gold", truth=t)


def test_the_tolerance_test_joins_the_holm_family():
    rng = np.random.default_rng(4)
    truth, base = truth_and_base(rng, docs=50)
    gate = GateSettings(bootstrap=0, symmetry_draws=2000)
    t = {r["doc_id"]: r for r in gold_records(truth)}
    p = G.pair("gsm8k", gold_records(base), gold_records(base), "base", "cfg")
    c = G.compare(p, gate, "config", "gsm8k-gold", truth=t)
    assert ("error" in {k for _, k in G.family([c])}) and len(G.family([c])) == 2
    aa = G.compare(p, gate, "aa", "gsm8k-gold", truth=t)
    assert G.family([aa]) == []                   # A/A comparisons are diagnostics


# ------------------------------------------------------------------------------ the sign-flip test it rests on
def test_signflip_greater_exact_small_case():
    # sums 3, -1, 2 (observed total 4): the 8 sign patterns give +-3 +-1 +-2 = 6, 4, 2, 0, 0, -2, -4, -6,
    # of which 2 reach 4
    assert stats.signflip_greater([3.0, -1.0, 2.0]) == pytest.approx(2 / 8)
    assert stats.signflip_greater([0.0, 0.0]) == 1.0


def test_signflip_greater_monte_carlo_matches_exact_and_is_one_sided():
    rng = np.random.default_rng(5)
    s = rng.normal(0.3, 1.0, 14)
    exact = stats.signflip_greater(s)
    mc = stats.signflip_greater(s, n_mc=40000, seed=1, exact_limit=0)
    assert abs(exact - mc) < 0.01
    assert stats.signflip_greater(-np.abs(s) - 0.1) == 1.0


def test_signflip_greater_holds_its_level_under_the_null():
    rng = np.random.default_rng(6)
    p = [stats.signflip_greater(rng.standard_t(3, 60), n_mc=999, seed=k) for k in range(300)]
    rate = np.mean(np.array(p) < 0.05)
    assert rate < 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300)     # 3 SE above alpha
