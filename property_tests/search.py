"""How the parity properties use hypothesis as a search, not a random generator.

- Every example is classified with `hypothesis.event` (padding mode, idle DP ranks, world size, why it was
  rejected): `--hypothesis-show-statistics` shows what a run really covered.
- `hypothesis.target` gets each example's worst error-to-bound ratio, so the targeting phase climbs toward
  near-failures (a fault that moves outputs by a fraction of the bound gets pushed over it) instead of
  sampling them by luck.
- A floor on real examples: an example the target skips, or one that hits a written-up known failure, is
  rejected and does not count. Hypothesis then keeps drawing, but stops when under 1 % of draws are valid, and a
  property could pass green on two real examples. `floor` makes such a property fail, naming the rejection
  reasons and their counts. (Hypothesis's filter_too_much health check cannot: it is raised only early in
  generation, as an error, without our reasons; checks/suite/profiles.py suppresses it in favour of this.)
"""
from __future__ import annotations

import functools
from collections import Counter

from hypothesis import event, note, reject, target

from dpep_parity.checks.core.batches import padding_mode

REAL = "judged"
_tally: Counter = Counter()


def rejected(why: str):
    """Reject this example for `why` (counted; shown in the floor's message and in hypothesis's statistics)."""
    short = why.splitlines()[0][:120]
    _tally[short] += 1
    event(f"rejected: {short}")
    reject()


def accept(unit: str, ex, res, known: str | None = None, steer: bool = True) -> float | None:
    """One example's result in the search: rejected when the target skipped it or when `known` (a written-up
    known failure explaining it) is set, else noted and judged (see `judged`)."""
    if res.skipped:
        rejected(f"skipped: {res.skipped}")
    note(res.report())
    if known:   # the pinned and sweep tests report it as xfail; the search goes on
        rejected(f"known failure: {known}")
    return judged(unit, ex, res, steer)


def tally_real() -> None:
    """Count a real example of a property that judges something other than parity (the invariances)."""
    _tally[REAL] += 1


def judged(unit: str, ex, res, steer: bool = True) -> float | None:
    """Count a real example, label what it covered, and steer the search by its error-to-bound ratio
    (hypothesis allows one target() per label and test case: a caller judging several forwards in one case
    passes steer=False and steers once with the largest returned ratio)."""
    _tally[REAL] += 1
    b = ex.batch
    idle = sum(1 for c in b.tokens_per_dp() if c == 0)
    event(f"tp{ex.layout.tp} dp{ex.layout.dp}")
    event(f"padding {padding_mode(b) if ex.layout.dp > 1 else 'none (dp 1)'}")
    event(f"idle DP ranks: {idle}")
    v = res.verdict
    if v is None or v.worst_excess != v.worst_excess or v.worst_excess == float("inf"):
        return None
    if steer:
        target(float(v.worst_excess), label=f"{unit}: worst error / bound")
    return float(v.worst_excess)


def floor(test):
    """Wrap a hypothesis test: after it passes, at least half of its max_examples must have been real
    (judged) examples, or it fails with the rejection reasons."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        _tally.clear()
        test(*args, **kwargs)
        check_floor(_settings_of(test).max_examples, Counter(_tally))
    return run


def _settings_of(test):
    from hypothesis import settings
    return getattr(test, "_hypothesis_internal_use_settings", None) or settings.default


def check_floor(max_examples: int, tally: Counter) -> None:
    need = max(1, max_examples // 2)
    real = tally.get(REAL, 0)
    if real >= need:
        return
    reasons = "\n".join(f"  {n:5d} x {why}" for why, n in tally.most_common() if why != REAL)
    raise AssertionError(
        f"only {real} real example(s) were judged, fewer than half of max_examples={max_examples} (floor {need}): "
        f"the property passed on too little evidence. Rejected examples:\n{reasons or '  none'}\n"
        f"Narrow the run to what the target supports (--world-sizes, --models, --dtypes) or fix the skips.")
