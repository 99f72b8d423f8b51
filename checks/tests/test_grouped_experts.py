"""The spec target's grouped-GEMM experts (checks.targets.spec: `routed_experts_grouped`, what it runs for bf16
on CUDA) on the CPU tier, where torch's grouped_mm also has bf16 and fp32 kernels: the EXPERTS_GROUPED variant
forces that path here.

Positive control: the variant passes the parity property (and the dispatch counts) at EP / MoE-TP layouts, with
MAX_LEN pad rows and an idle DP rank, in float32 and bfloat16. Negative control: the same path with each
expert's stacked weights taken from the next expert (a grouped-kernel bug M04's way) fails it, so the grouped
path is what ran.
"""
from __future__ import annotations

import pytest
import torch

from dpep_parity.checks.catalog.variants import ExpertsGrouped
from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.spec import SpecTarget, _grouped_mm
from dpep_parity.fixtures.build import fixture_path

pytestmark = pytest.mark.skipif(_grouped_mm() is None, reason="this torch has no grouped_mm")

R = Request
DECODE_UNEVEN = Batch(((R(4, 1), R(2, 1), R(5, 1)), (R(3, 1),)), 5)   # MAX_LEN: pad rows on DP rank 1
EXTEND_IDLE = Batch(((R(3, 6), R(0, 4)), ()), 11)                      # SUM_LEN, DP rank 1 idle
MIXED_DP4 = Batch(((R(4, 1), R(2, 1)), (R(3, 1),), (), (R(5, 1),)), 9)  # MAX_LEN over 4 DP ranks, one idle
CASES = [("qwen3-moe", Layout(4, 2, 2), DECODE_UNEVEN), ("qwen2-moe-shared", Layout(4, 2, 2), EXTEND_IDLE),
         ("qwen3-moe", Layout(2, 1, 2), EXTEND_IDLE), ("qwen2-moe-shared", Layout(4, 4, 4), MIXED_DP4)]


class GroupedNeighbourWeights(ExpertsGrouped):
    """Grouped experts whose stacked weights are rolled by one expert: expert e computed with e+1's weights."""

    def expert_stack(self, i, local):
        return tuple(torch.roll(t, 1, dims=0) for t in super().expert_stack(i, local))


def _target(cls):
    t = SpecTarget()
    t.model_class, t.name = cls, f"spec~{cls.__name__}"
    return t


GROUPED = _target(ExpertsGrouped)
BROKEN = _target(GroupedNeighbourWeights)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture,layout,batch", CASES, ids=[f"{f}-{lay}" for f, lay, _ in CASES])
def test_grouped_experts_pass_parity_and_dispatch(fixture, layout, batch, dtype):
    for unit in ("moe", "decoder"):
        res = run_example(f"{__name__}:GROUPED", unit, str(fixture_path(fixture)), layout, batch, dtype, layer=1)
        assert res.ok, res.report()
        if unit == "moe":
            assert "dispatch" in {c.prop for c in res.checks}, res.report()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_with_neighbour_weights_fail_parity(dtype):
    res = run_example(f"{__name__}:BROKEN", "moe", str(fixture_path("qwen3-moe")), Layout(4, 2, 2), EXTEND_IDLE,
                      dtype, layer=1)
    assert "parity" in {c.prop for c in res.failures()}, res.report()
