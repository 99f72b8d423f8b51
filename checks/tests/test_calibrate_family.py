"""The family calibration's planted faults are what they claim: the doubled output fails with |sut|/|truth| = 2,
the 1-ulp bias moves every element by one ulp and stays within the max-error bound, and the wrapper leaves the
target's other answers (units, skips) alone. Control: the unwrapped target passes the same example."""
from __future__ import annotations

import pytest

from dpep_parity.checks.core.batches import parse_batch
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.tools import calibrate_family
from dpep_parity.fixtures.build import fixture_path


@pytest.mark.slow
def test_planted_faults_on_one_example():
    model, batch = str(fixture_path("qwen3-moe")), parse_batch("dp0:0+24,3+20 seed=4")
    args = ("moe", model, Layout(1, 1, 1), batch, "bfloat16", 0)
    good = run_example("spec", *args)
    doubled = run_example("checks.tools.calibrate_family:DOUBLED_SPEC", *args)
    biased = run_example("checks.tools.calibrate_family:BIASED_SPEC", *args)
    assert good.ok, good.report()
    assert not doubled.ok and abs(doubled.verdict.ratio - 2) < 0.01, doubled.report()
    assert biased.verdict.worst_excess < 1.5 and biased.verdict.bias_z > 0, biased.report()
    planted = calibrate_family.DOUBLED_SPEC
    assert planted.units == planted.inner.units and planted.unsupported_families == planted.inner.unsupported_families


def test_examples_cover_every_layout_and_an_idle_rank():
    got = list(calibrate_family.examples("glm4-moe", "moe"))
    layouts = {lay for lay, _, _ in got}
    assert {lay.tp for lay in layouts} == {1, 2, 4} and any(lay.dp == 4 and lay.ep == 4 for lay in layouts)
    assert any(b.tokens_per_dp()[1] == 0 for lay, b, _ in got if lay.dp > 1)      # DP rank 1 idle
    assert {layer for _, _, layer in got} == {0, 1}                                # dense and sparse layer
