"""Controls of the stateful property (property_tests/test_stateful.py) and of poisoned allocations
(checks.harness.poison): a leak between forwards and a read of memory never written are caught, deterministically;
correct code passes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.poison import poisoned
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.suite import profiles
from dpep_parity.checks.suite.suite_options import SuiteOptions
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.property_tests.test_stateful import ForwardSequence

NO_SHRINK = [Phase.explicit, Phase.generate]


def test_poisoned_allocations_hold_nan_and_only_inside_the_block():
    with poisoned():
        a, b = torch.empty(3), torch.ones(2).new_empty(4)
        c, d = torch.empty_like(torch.ones(2, dtype=torch.bfloat16)), torch.empty(2, dtype=torch.long)
        z = torch.zeros(2)
    assert a.isnan().all() and b.isnan().all() and c.isnan().all() and c.dtype == torch.bfloat16
    assert d.dtype == torch.long and not z.isnan().any()        # integers and initialised memory untouched
    assert torch.empty is not None and not getattr(torch.empty, "__wrapped__", None)   # restored


class MoeSequences(ForwardSequence):
    units = ("moe",)


def sequences(target: str, runs: int) -> None:
    MoeSequences.suite = SuiteOptions(target, (2,), ("float32",), ("qwen2-moe-shared",), "cpu", 60.0)
    run_state_machine_as_test(MoeSequences, settings=settings(
        max_examples=runs, stateful_step_count=4, derandomize=True, database=None, deadline=None,
        phases=NO_SHRINK, suppress_health_check=list(profiles.SUPPRESSED)))


def test_sequences_pass_on_the_spec():
    """Positive control: forward after forward on one build of the spec, poisoned, all equal one device."""
    sequences("spec", 6)


def test_sequences_catch_metadata_captured_per_batch_size():
    """Negative control: M09 replays the DP offsets of the first batch of a size for a later batch of that
    size spread differently; every single forward of a fresh build is right, a rebalance step is not."""
    with pytest.raises(AssertionError, match=r"forward \d of one build"):
        sequences("checks.catalog.mutants:M09", 12)


def test_poison_makes_a_read_of_unwritten_memory_fail_every_time():
    """Negative control: M10 gathers through a fresh buffer it never clears. Whether that passes depends on
    what the allocator hands back; poisoned, the first forward fails with non-finite values, every time."""
    ex = (str(fixture_path("qwen2-moe-shared")), Layout(2, 2, 1), Batch(((R(0, 3),), (R(1, 2),)), 4), "float32")
    for i in range(2):
        res = run_example("checks.catalog.mutants:M10", "moe", *ex, build_id=f"poison-{i}", poison=True)
        assert not res.ok and "non-finite" in res.report(), res.report()
    spec = run_example("spec", "moe", *ex, build_id="poison-spec", poison=True)
    assert spec.ok, spec.report()                                  # positive control: correct code never reads it
