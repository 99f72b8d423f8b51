"""Precision: the target's error in a half-precision dtype is no larger than a legitimate computation's.

A precision fault (an intermediate kept in the activation dtype where the single-device model keeps float32:
RMSNorm's statistics, RoPE's angles) moves bfloat16 outputs by about as much as a legitimate reordering, so
no single row's bound sees it. This property pools the evidence over every token of every example of a run
(checks/core/numerics.py, "precision"; docs/precision.md): per token, the log of the target's error energy
against the float64 truth over the largest error of the legitimate same-dtype computations of the same rows
(the reference, its decoy-company variants, and the spec at the same layout, which rounds the TP partials
the way the layout legitimately does), tested against 0 over the run.

Examples are drawn for evidence, not for corner cases (test_parity.py's job): every DP rank busy, several
requests of several tokens each, and prefixes that are either short or long (64-200 positions: RoPE
faults grow with the position, and the catalog's other strategies stay below 11). Every example is still
judged by all of checks.judge.parity's checks; the pooled test runs once the search is over.
"""
from __future__ import annotations

import uuid

import pytest
from hypothesis import strategies as st

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.protocol import known_failure, resolve, skip_reason
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.specs import FIXTURES
from dpep_parity.property_tests.pooled import HALF, pooled_precision
from dpep_parity.property_tests.strategies import Example, layouts_for

LONG = (64, 200)   # long prefixes: a position x frequency rounded to bfloat16 (8 significant bits) is off by up to pos / 512 rad


@st.composite
def busy_batches(draw, dp: int) -> Batch:
    """Every DP rank extends 2-4 requests of 16-32 tokens after a short or a long prefix: at least 32 tokens
    per DP rank even in the simplest example hypothesis draws first."""
    def request():
        prefix = draw(st.one_of(st.integers(0, 4), st.integers(*LONG)))
        return Request(prefix, draw(st.integers(16, 32)))
    per = tuple(tuple(request() for _ in range(draw(st.integers(2, 4)))) for _ in range(dp))
    return Batch(per, draw(st.integers(0, 2**16)))


@st.composite
def precision_examples(draw, fixtures, world_sizes, dtypes, unit: str) -> Example:
    fixture = draw(st.sampled_from(sorted(fixtures)))
    layout = draw(st.sampled_from(layouts_for(fixture, world_sizes, with_dp_lm_head=units.get(unit).whole_model)))
    n_layers = FIXTURES[fixture].num_hidden_layers
    layer = 0 if units.get(unit).whole_model else draw(st.integers(0, n_layers - 1))
    return Example(fixture, layout, draw(busy_batches(layout.dp)), draw(st.sampled_from(dtypes)), layer)


def check_precision(suite, unit: str):
    dtypes = [d for d in suite.dtypes if d in HALF]
    if not dtypes:
        pytest.skip(f"no half-precision dtype in --dtypes {','.join(suite.dtypes)}: in float32 the reference "
                    f"keeps every intermediate in the dtype itself, there is no precision class to test")
    tgt = resolve(suite.target)
    if unit not in tgt.units:
        pytest.skip(skip_reason(tgt, unit, None, None))

    def run(ex):
        return run_example(suite.target, unit, str(fixture_path(ex.fixture)), ex.layout, ex.batch, ex.dtype,
                           ex.layer, suite.device, suite.deadline, build_id=uuid.uuid4().hex,
                           layout_reference=True)

    pooled_precision(unit, precision_examples(suite.fixtures, suite.world_sizes, dtypes, unit), run,
                     lambda res, ex: known_failure(tgt, res, ex.fixture, ex.layer),
                     lambda ex: ex.replay(unit, suite.target))


def test_moe_precision(suite):
    """The MoE block: router, experts, their sum, the DP gather / scatter."""
    check_precision(suite, "moe")


def test_attention_precision(suite):
    """Attention: qk-norm, RoPE at long positions, the attention-TP partial sums."""
    check_precision(suite, "attention")


def test_decoder_precision(suite):
    """The decoder layer: both RMSNorms, attention, the residual, the MLP."""
    check_precision(suite, "decoder")


def test_model_precision(suite):
    """The whole model: every layer, the final norm, the lm_head's logits."""
    check_precision(suite, "model")
