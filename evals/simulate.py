"""The gate's error rates by simulation: synthetic paired records driven through the gate's own functions
(`gate.compare`, `gate.decide`, `gate.worst`), for a whole sign-off matrix (every configuration, both tasks,
every measure), so what is measured is the verdict a release manager gets.

    python -m evals.simulate --runs 400 --power-runs 100 --mmlu 600 --gsm8k 800 --gold-tokens 50 --configs 4 \
        [--tables gate,tolerance,power]

Every simulated sign-off has the float64 truth run, so the tolerance test's pooled and tail tests are in the
Holm family, and each run's reference-token errors carry router near-tie flips at the rates measured on served
reference tokens (`NUMERICS`, evals.near_ties): some shared by both runs, some each run's own, heavy-tailed.

Scenarios (per replicate, every configuration against one baseline):
- A/A: identical systems whose outputs flip on a fraction `flip` of units, each flip as likely either way
  (exchangeable pairs). `independent`: flips independent across units. `correlated`: flips concentrate in
  some clusters (MMLU subjects, GSM8K documents' reference tokens) and, inside a cluster, mostly go the same
  way and towards the same answer letter (a cached few-shot prefix per subject, a layout that rounds one
  subject's prompts differently), still with no direction overall. A FAIL is a false alarm.
- boundary: one configuration is worse by exactly the margin on one measure (other measures, and the other
  configurations, as in A/A). A PASS of that configuration is a wrong PASS.
- tolerance: A/A judged by the gate and by the former per-token rule (`per_token_rule`), and configuration 0
  with a fraction of its documents corrupted from a random reference token on (a decode step reading wrong
  rows, as catalog mutant M08): the tail test's power.
- power: configuration 0 worse by 1-4 points on MMLU or GSM8K: how often that measure FAILs, beside the
  pre-run power line (stats.mdd_under_drop).
The rates are fractions of replicates; `rate_upper` is their one-sided 95% Clopper-Pearson bound.

The synthetic records are those of the shipped tasks (evals/tasks/mmlu.py, gsm8k.py); a task added to the
registry is gated by the same functions but not simulated here.

Written here rather than taken from a library: the thing simulated is this gate's own decision rule over
this suite's record format; no public package models paired lm-eval records per configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dpep_parity.evals import gate as G
from dpep_parity.evals import stats, tasks
from dpep_parity.evals.matrix import GateSettings

N_SUBJECTS = 57            # MMLU subjects; the seeded subset spreads items over all of them
MMLU_ACC, GSM8K_ACC, GOLD_ACC = 0.45, 0.3, 0.6     # baseline accuracies (the levels barely matter)


@dataclass(frozen=True)
class Numerics:
    """Reference-token log-probability errors against the float64 truth (the tolerance test's input): rounding
    noise on every token (half-normal, median `noise`), and router near-ties resolved to another expert than
    the truth's, which err by a heavy-tailed amount (|Student t, 2 df|, median `flip_error`): on a fraction
    `shared` of tokens both runs flip alike (the dtype's rounding of the same logits), on a fraction `near_tie`
    each run flips on its own. Measured on served reference tokens (`NUMERICS`)."""
    noise: float          # nats: median error where the routing matches the truth's
    shared: float         # fraction of reference tokens both runs route otherwise than the truth
    near_tie: float       # fraction each run routes otherwise on its own
    flip_error: float     # nats: median error at a flipped token


# `python -m evals.near_ties --fixture F --layouts tp1,tp2-dp2,tp4-dp4-ep4 --docs 200 --data-dir ../shared/data`,
# bfloat16 (docs/evals.md, "Near-tie flips"): per layout, the share of reference tokens routed otherwise than the
# float64 truth in some layer (p) and, per pair of layouts, the share routed differently (d); a run's own flips
# are then about d / 2 and the shared ones p - d / 2. Median errors at flipped tokens and elsewhere.
NUMERICS = {
    "fixture": Numerics(noise=0.0054, shared=0.0125, near_tie=0.0028, flip_error=0.066),   # 2 layers: p 1.5 %,
    #                                                                                         d 0.50-0.58 %
    "deep": Numerics(noise=0.0102, shared=0.064, near_tie=0.043, flip_error=0.050),         # 8 layers: p 10.7 %,
    #                                                                                         d 8.05-8.79 %
}
DEFAULT_NUMERICS = NUMERICS["deep"]     # the larger share of flips a run makes on its own


@dataclass(frozen=True)
class Scenario:
    name: str
    flip: float                    # fraction of units whose outcome differs between the two runs
    correlated: bool = False
    boundary: str | None = None    # measure at the boundary (config 0 worse by its margin), None: A/A
    numerics: Numerics | None = DEFAULT_NUMERICS   # None: no float64 truth run (a server engine, a float32 baseline)
    shift: float | None = None     # how much worse configuration 0 is on `boundary` (a fraction; None: its margin)
    corrupt: float = 0.0           # fraction of configuration 0's documents whose reference tokens, from a random
    #                                one on, err by O(0.5) nats more (a decode step that reads wrong rows: M08)


@dataclass(frozen=True)
class Sizes:
    mmlu: int = 600
    gsm8k: int = 800
    gold_tokens: int = 50          # reference tokens per GSM8K document (gsm8k-gold units; the default run: 51)
    configs: int = 4


# ------------------------------------------------------------------------------------ synthetic records
def _cluster_params(rng, groups: int, flip: float, correlated: bool):
    """Per cluster: its flip rate, the share of its flips that favour the configuration, and (MMLU) the
    letter its flips drift to. Correlated clusters: rates gamma-spread (shape 0.5) around `flip`, 90% of a
    cluster's flips one way, the way drawn per cluster with probability 1/2 (no direction overall)."""
    if not correlated:
        return np.full(groups, flip), np.full(groups, 0.5), None
    rate = np.minimum(rng.gamma(0.5, flip / 0.5, groups), 0.5)
    rate *= flip / max(rate.mean(), 1e-12)
    share = np.where(rng.random(groups) < 0.5, 0.9, 0.1)
    return np.minimum(rate, 1.0), share, rng.integers(0, 4, groups)


def mmlu_pair(rng, n: int, flip: float, correlated: bool, shift: float = 0.0):
    """Paired MMLU records; `shift` > 0 makes the configuration worse by `shift` (a fraction of items)."""
    subj = np.arange(n) % N_SUBJECTS
    rate, share, letter = _cluster_params(rng, N_SUBJECTS, flip, correlated)
    gold = rng.integers(0, 4, n)
    base = np.where(rng.random(n) < MMLU_ACC, gold, (gold + rng.integers(1, 4, n)) % 4)
    cfg = base.copy()
    flips = rng.random(n) < rate[subj]
    for i in np.flatnonzero(flips):
        # a flip moves one run's answer: towards the cluster's letter when correlated, else anywhere else
        other = letter[subj[i]] if letter is not None and letter[subj[i]] != base[i] else \
            (base[i] + rng.integers(1, 4)) % 4
        if rng.random() < share[subj[i]]:
            base[i] = other            # the baseline moved: the configuration kept the first answer
        else:
            cfg[i] = other
    if shift > 0:                      # the configuration loses items it had right: `shift` of n on average
        lose = _losses(rng, np.flatnonzero((cfg == gold) & ~flips), shift * n)
        cfg[lose] = (gold[lose] + 1) % 4
    return _mmlu_records(base, gold, subj), _mmlu_records(cfg, gold, subj)


def _losses(rng, right, expected: float):
    """Each of the `right` units lost independently, `expected` of them on average (a true difference whose
    observed size varies from run to run, as an engine's would)."""
    return right[rng.random(len(right)) < min(1.0, expected / max(len(right), 1))]


def _mmlu_records(pred, gold, subj) -> list[dict]:
    # the per-item fields are computed on whole arrays and converted once (`tolist` gives the Python ints and
    # floats the records hold); only the dicts are built per item
    lls = np.full((pred.size, 4), -2.0)
    lls[np.arange(pred.size), pred] = -1.0         # the chosen letter's log-likelihood
    acc = (pred == gold).astype(float)
    return [{"task": "mmlu", "doc_id": f"s{s}/{i}", "prompt_hash": str(i), "subject": f"s{s}", "gold": g,
             "lls": ll, "pred": p, "metrics": {"acc": a}}
            for i, (p, g, s, ll, a) in enumerate(zip(pred.tolist(), gold.tolist(), subj.tolist(), lls.tolist(),
                                                     acc.tolist()))]


def token_errors(rng, shape, num: Numerics) -> tuple[np.ndarray, np.ndarray]:
    """Two runs' reference-token errors |log p - log p_truth| (`Numerics`)."""
    def flip_errors(k: int) -> np.ndarray:
        return np.abs(rng.standard_t(2, k)) * (num.flip_error / 0.8165)      # |t2| has median 0.8165

    runs = [np.abs(rng.normal(0.0, num.noise / 0.6745, shape)) for _ in range(2)]   # half-normal: 0.6745 sigma
    both = rng.random(shape) < num.shared
    common = flip_errors(int(both.sum()))
    for err in runs:
        err[both] += common
        own = (rng.random(shape) < num.near_tie) & ~both
        err[own] += flip_errors(int(own.sum()))
    return runs[0], runs[1]


def gsm8k_pair(rng, n: int, tokens: int, flip: float, correlated: bool, shift_items: float = 0.0,
               shift_tokens: float = 0.0, num: Numerics | None = DEFAULT_NUMERICS, corrupt: float = 0.0):
    """Paired GSM8K records with reference-token verdicts (gsm8k-gold) and log-probabilities, and the float64
    truth run's records (doc id -> record; None without `num`). Items are independent documents; the
    reference tokens of one document are a cluster."""
    def binary_pair(size, rate, share, acc, shift):
        yb = (rng.random(size) < acc).astype(float)
        yc = yb.copy()
        flips = rng.random(size) < rate
        base_moves = rng.random(size) < share
        # a flip: exactly one run is right, as likely either one (share 1/2) unless correlated
        right_on_cfg = ~base_moves
        yb[flips] = (~right_on_cfg[flips]).astype(float)
        yc[flips] = right_on_cfg[flips].astype(float)
        if shift > 0:
            yc[_losses(rng, np.flatnonzero((yc == 1) & ~flips), shift * size)] = 0.0
        return yb, yc

    ib, ic = binary_pair(n, np.full(n, flip), np.full(n, 0.5), GSM8K_ACC, shift_items)
    rate, share, _ = _cluster_params(rng, n, flip, correlated)
    doc = np.repeat(np.arange(n), tokens)
    tb, tc = binary_pair(n * tokens, rate[doc], share[doc], GOLD_ACC, shift_tokens)
    truth = -rng.gamma(2.0, 3.0, (n, tokens))                 # reference-token log-probabilities, float64
    err_b, err_c = token_errors(rng, (n, tokens), num) if num else (np.zeros((n, tokens)),) * 2
    if corrupt > 0:                                           # from a random token on, wrong rows: O(0.5) nats
        for d in np.flatnonzero(rng.random(n) < corrupt):
            start = rng.integers(0, tokens)
            err_c[d, start:] += np.abs(rng.normal(0.0, 0.5, tokens - start))
    errs = (err_b, err_c)
    recs = []
    for (y, t), e in zip(((ib, tb), (ic, tc)), errs):
        # one row of reference tokens per document, converted to Python bools and floats by one `tolist` each
        # rather than token by token (the simulation's hot spot: 2 x 800 x 50 tokens per configuration)
        greedy = t.reshape(n, tokens) != 0
        logprob = truth + np.where(rng.random((n, tokens)) < 0.5, e, -e)
        # the generation text names the document, the run's outcome and the baseline's: the same text in both
        # runs when the outcome did not change (agreement is reported, not gated). Iterating `y` keeps the
        # metric a numpy float, as indexing it did.
        rows = zip(y, y.astype(int).tolist(), ib.astype(int).tolist(), greedy.tolist(), logprob.tolist())
        recs.append([{"task": "gsm8k", "doc_id": f"g{i}", "prompt_hash": str(i), "subject": None,
                      "generation": f"{i}:{right}:{base_right}", "metrics": {"flexible-extract": metric},
                      "gold_greedy": g, "gold_logprob": lp}
                     for i, (metric, right, base_right, g, lp) in enumerate(rows)])
    truth_recs = {f"g{i}": {"doc_id": f"g{i}", "prompt_hash": str(i), "gold_logprob": lp}
                  for i, lp in enumerate(truth.tolist())} if num else None
    return recs[0], recs[1], truth_recs


# ------------------------------------------------------------------------------------ one sign-off
Decide = Callable[[list[dict], GateSettings], None]


def signoff(rng, sc: Scenario, sizes: Sizes, gate: GateSettings, decide: Decide = G.decide) -> list[dict]:
    """One simulated sign-off: every configuration's comparisons, decided together."""
    comparisons = []
    for k in range(sizes.configs):
        at = sc.boundary if k == 0 else None
        m = {t: (gate.margin_for(t) / 100 if sc.shift is None else sc.shift) if at == t else 0.0
             for t in G.MEASURES}
        mb, mc = mmlu_pair(rng, sizes.mmlu, sc.flip, sc.correlated, m["mmlu"])
        gb, gc, truth = gsm8k_pair(rng, sizes.gsm8k, sizes.gold_tokens, sc.flip, sc.correlated, m["gsm8k"],
                                   m["gsm8k-gold"], sc.numerics, sc.corrupt if k == 0 else 0.0)
        for task, b, c in (("mmlu", mb, mc), ("gsm8k", gb, gc)):
            p = G.pair(task, b, c, "base", f"cfg{k}")
            for measure in G.measures_of(task, p):
                tr = truth if tasks.measure(measure).tolerance else None
                comparisons.append(G.compare(p, gate, "config", measure, truth=tr))
    decide(comparisons, gate)
    return comparisons


def rates(sc: Scenario, sizes: Sizes, runs: int, seed: int = 0, gate: GateSettings | None = None,
          decide: Decide = G.decide) -> dict:
    """Fractions of `runs` simulated sign-offs: any FAIL (false alarm under A/A), a PASS of the sign-off,
    and for boundary scenarios a PASS of the configuration at the boundary on that measure."""
    gate = gate or fast_gate()
    rng = np.random.default_rng([seed, int(sc.flip * 1e6), sc.correlated, G.MEASURES.index(sc.boundary) + 1 if sc.boundary else 0])
    fails = passes = boundary_pass = boundary_fail = 0
    with _cyclic_gc_paused():
        for _ in range(runs):
            cs = signoff(rng, sc, sizes, gate, decide)
            verdict = G.worst(c["verdict"] for c in cs)
            fails += verdict == "FAIL"
            passes += verdict == "PASS"
            if sc.boundary:
                at = next(c for c in cs if c["config"] == "cfg0" and c["task"] == sc.boundary)
                boundary_pass += at["verdict"] == "PASS"
                boundary_fail += at["verdict"] == "FAIL"
    out = {"scenario": sc.name, "flip": sc.flip, "correlated": sc.correlated, "boundary": sc.boundary,
           "runs": runs, "fail": fails / runs, "pass": passes / runs,
           "fail_upper": stats.cp_upper(fails, runs, 0.05)}
    if sc.boundary:
        out["boundary_pass"] = boundary_pass / runs
        out["boundary_pass_upper"] = stats.cp_upper(boundary_pass, runs, 0.05)
        out["boundary_fail"] = boundary_fail / runs          # the shifted measure FAILed: the drop was detected
    return out


def per_token_rule(comparisons: list[dict], gate: GateSettings) -> None:
    """The served tolerance test's former per-token rule, for comparison: the gate, then a FAIL, outside the
    Holm family, wherever a reference token erred more than FACTOR x the baseline's largest error."""
    G.decide(comparisons, gate)
    for c in comparisons:
        if c.get("error") and c["error"]["beyond"] > 0:
            c["verdict"] = "FAIL"


@contextlib.contextmanager
def _cyclic_gc_paused():
    """A sign-off allocates some 30,000 small containers (records, per-token lists), which keeps triggering
    Python's cyclic garbage collector, and its full passes walk every live object of the process (200,000 and
    more: numpy, scipy, the test session): a fifth to a quarter of the simulation's time, measured (10 sign-offs:
    3.8 s with it, 2.5-3.0 s without). The records hold no reference cycles, so reference counting frees them
    anyway; the collector is back on afterwards (unless it was off before)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fast_gate(**kw) -> GateSettings:
    """The default gate without the reported-only bootstrap interval and with fewer Monte Carlo sign flips
    for the symmetry p-value (its resolution, 1/2000, is far below alpha / family size)."""
    return dataclasses.replace(GateSettings(), bootstrap=0, symmetry_draws=2000, **kw)


def scenarios(flips=(0.005, 0.01, 0.02)) -> list[Scenario]:
    """The gate's table: A/A at each flip rate, independent and correlated, and each measure at its boundary."""
    out = [Scenario(f"A/A {'correlated' if cor else 'independent'} {100 * f:g}%", f, cor)
           for f in flips for cor in (False, True)]
    out += [Scenario(f"boundary {m} {100 * f:g}%", f, False, m) for m in G.MEASURES for f in (0.0, flips[1])]
    return out


def tolerance_scenarios() -> list[tuple[Scenario, str]]:
    """The tolerance test's table, per measured `NUMERICS`: A/A judged by the gate and by the former per-token
    rule, and configuration 0 with 1-10 % of its documents corrupted (what the tail test finds)."""
    out = []
    for name, num in NUMERICS.items():
        aa = Scenario(f"A/A 1%, {name} near-ties", 0.01, numerics=num)
        out += [(aa, "gate"), (aa, "per-token rule")]
        out += [(Scenario(f"{100 * f:g}% of documents corrupted, {name} near-ties", 0.01, numerics=num, corrupt=f),
                 "gate") for f in (0.01, 0.025, 0.05, 0.1)]
    return out


def power_scenarios(drops=(0.01, 0.02, 0.03, 0.04)) -> list[Scenario]:
    """Configuration 0 worse by `drop` on one measure (1 % flips): the gate's power by simulation."""
    return [Scenario(f"{m} {100 * d:g} pts worse", 0.01, False, m, shift=d) for m in ("mmlu", "gsm8k")
            for d in drops]


DECIDES = {"gate": G.decide, "per-token rule": per_token_rule}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--mmlu", type=int, default=Sizes.mmlu)
    ap.add_argument("--gsm8k", type=int, default=Sizes.gsm8k)
    ap.add_argument("--gold-tokens", type=int, default=Sizes.gold_tokens)
    ap.add_argument("--configs", type=int, default=Sizes.configs)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--power-runs", type=int, default=100,
                    help="sign-offs per row where a rate far from alpha is estimated (corrupted documents, drops)")
    ap.add_argument("--tables", default="gate,tolerance,power",
                    help="which tables: gate (error rates), tolerance (near-ties, corrupted documents), power")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tables = set(a.tables.split(","))
    if tables - {"gate", "tolerance", "power"}:
        ap.error(f"--tables: unknown {sorted(tables - {'gate', 'tolerance', 'power'})}")
    sizes = Sizes(a.mmlu, a.gsm8k, a.gold_tokens, a.configs)
    rows = []

    def run(sc, how="gate", runs=a.runs):
        r = rates(sc, sizes, runs, a.seed, decide=DECIDES[how]) | {"decide": how}
        rows.append(r)
        return r

    if "gate" in tables:
        print("| scenario | sign-off FAIL (95% upper) | sign-off PASS | boundary PASS (95% upper) |")
        print("|---|---|---|---|")
        for sc in scenarios():
            r = run(sc)
            bp = f"{r['boundary_pass']:.3f} ({r['boundary_pass_upper']:.3f})" if sc.boundary else ""
            print(f"| {sc.name} | {r['fail']:.3f} ({r['fail_upper']:.3f}) | {r['pass']:.3f} | {bp} |", flush=True)
    if "tolerance" in tables:
        print("\n| scenario | judged by | sign-off FAIL (95% upper) |")
        print("|---|---|---|")
        for sc, how in tolerance_scenarios():
            r = run(sc, how, a.power_runs if sc.corrupt else a.runs)
            print(f"| {sc.name} | {how} | {r['fail']:.3f} ({r['fail_upper']:.3f}) |", flush=True)
    if "power" in tables:
        gate = fast_gate()
        family = sizes.configs * sum(tasks.get(t).tests(True, True) for t in ("mmlu", "gsm8k"))
        n = {"mmlu": sizes.mmlu, "gsm8k": sizes.gsm8k}
        print(f"\n| drop | FAILed (detected) | pre-run line: drop detected with power {gate.power:.0%} "
              f"(Holm over {family}) |")
        print("|---|---|---|")
        for sc in power_scenarios():
            r = run(sc, runs=a.power_runs)
            line = stats.mdd_under_drop(n[sc.boundary], sc.flip, gate.alpha / family, gate.power)
            print(f"| {sc.name} | {r['boundary_fail']:.3f} | {100 * line:.2f} pts |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sizes": dataclasses.asdict(sizes), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
