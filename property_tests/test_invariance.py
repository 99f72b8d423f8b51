"""Invariance: one request's outputs, bitwise, whatever is batched with it (batch), wherever the DP controller
places it (placement) and, where the target claims it, under other layouts (layout), for every unit
(checks/judge/invariance.py). Metamorphic: no float64 oracle, the request's
own outputs in one context are the other context's truth.

A target that promises an invariance (`invariances`, docs/targets.md) fails on the first pair that breaks it,
shrunk to the smallest pair, with a replay line naming both contexts. A target that promises none passes: the
pairs' drift (rows that change, max ULP, per unit and layout) is collected and printed after the run, as
information (the parity properties bound such changes; only a promise makes them wrong).
"""
from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from dpep_parity.checks.core.topology import layouts_for
from dpep_parity.checks.judge import invariance
from dpep_parity.checks.targets.protocol import resolve, skip_reason
from dpep_parity.checks.units import UNITS
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.property_tests import search
from dpep_parity.property_tests.strategies import invariance_pairs, layout_pairs


def check_pair(suite, pair: invariance.Pair) -> invariance.Drift:
    target = resolve(suite.target)
    why = skip_reason(target, pair.unit, fixture_config(pair.fixture), pair.a.layout)
    if why:
        search.rejected(f"skipped: {why}")
    if pair.a.batch.nobody_runs or pair.b.batch.nobody_runs:
        search.rejected("a context where every DP rank is idle runs no forward")
    drift = invariance.measure(pair, suite.target, str(fixture_path(pair.fixture)), suite.device, suite.deadline)
    note(drift.report())
    if drift.unjudged:      # a crash or a hang: the parity properties' verdict, not this one's
        search.rejected(f"not judged: {drift.unjudged.splitlines()[0]}")
    search.tally_real()
    return drift


@pytest.mark.parametrize("kind", ["batch", "placement"])
@pytest.mark.parametrize("unit", UNITS)
@search.floor
@given(data=st.data())
def test_invariance(suite, unit, kind, data):
    """The request's outputs are bitwise the same in both contexts, if the target promises it; else the drift
    is recorded for the run's report."""
    target = resolve(suite.target)
    if unit not in target.units:
        pytest.skip(skip_reason(target, unit, None, None))
    if kind == "placement" and not any(lay.dp > 1 for f in suite.fixtures
                                       for lay in layouts_for(f, suite.world_sizes)):
        # every draw would be rejected (hypothesis: Unsatisfiable): a request has no other DP rank to go to
        pytest.skip(f"placement needs two DP ranks: no layout of world sizes {list(suite.world_sizes)} has one")
    pair = data.draw(invariance_pairs(suite.fixtures, suite.world_sizes, suite.dtypes, unit, kind), label="pair")
    drift = check_pair(suite, pair)
    if kind not in invariance.claims(target):
        invariance.log_drift(drift)
        return
    assert drift.equal, (f"{suite.target} promises {kind} invariance:\n{drift.report()}\n"
                         f"replay: {pair.replay(suite.target)}")


@pytest.mark.parametrize("unit", UNITS)
@search.floor
@given(data=st.data())
def test_layout_invariance(suite, unit, data):
    """Where the target claims layouts equal (`invariant_layouts`), the request's outputs are bitwise the same
    under each of them."""
    target = resolve(suite.target)
    if unit not in target.units:
        pytest.skip(skip_reason(target, unit, None, None))
    if "layout" not in invariance.claims(target):
        pytest.skip(f"{suite.target} promises no layout invariance (the drift across layouts: "
                    "dpep invariance pair ... --against-layout)")
    pair = data.draw(layout_pairs(suite.fixtures, suite.world_sizes, suite.dtypes, unit,
                                  lambda cfg: invariance.layout_groups(target, cfg)), label="pair")
    drift = check_pair(suite, pair)
    assert drift.equal, (f"{suite.target} promises layout invariance ({pair.a.layout} = {pair.b.layout}):\n"
                         f"{drift.report()}\nreplay: {pair.replay(suite.target)}")
