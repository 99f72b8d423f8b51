"""The serving engine's invariance (checks/serving/invariance.py): other arrival orders, DP dispatch policies and
concurrency limits must not change a request's prompt logits or forced log-probabilities for a target that
promises batch and placement invariance. Positive control: the batch-invariant spec; negative controls: two
invariance mutants whose broken promise shows through serving (I02: a row's experts summed in load order; I03: a
reduction keyed to the DP rank); the plain spec, which promises nothing, is measured, not judged."""
from __future__ import annotations

import pytest

from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.serving.invariance import VARIANTS, served_drift
from dpep_parity.fixtures.build import fixture_path

LAYOUT = Layout.parse("tp2-dp2-ep2")


def _drift(target):
    return {d.variant: d for d in served_drift(str(fixture_path("qwen3-moe")), LAYOUT, target)}


def test_the_batch_invariant_spec_serves_the_same_bits_every_way():
    drifts = _drift("checks.catalog.variants:BATCH_INVARIANT")
    assert sorted(drifts) == sorted(VARIANTS)
    assert all(d.changed == 0 for d in drifts.values()), [d.line() for d in drifts.values()]


@pytest.mark.parametrize("mutant,variant", [("I02", "one running request per DP rank"),
                                            ("I03", "reversed arrival")])
def test_a_broken_promise_shows_through_serving(mutant, variant):
    d = _drift(f"checks.catalog.invariance_mutants:{mutant}")[variant]
    assert d.changed > 0 and 0 < d.max_abs < 1e-4, d.line()     # a few float32 ulps: parity cannot see it
