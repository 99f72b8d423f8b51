"""Precision: the target's error in a half-precision dtype is no larger than a legitimate computation's.

A precision fault (an intermediate kept in the activation dtype where the single-device model keeps float32:
RMSNorm's statistics, RoPE's angles) moves bfloat16 outputs by about as much as a legitimate reordering, so
no single row's bound sees it. This property pools the evidence over every token of every example of a run
(checks/numerics.py, "precision"; docs/precision.md): per token, the log of the target's error energy
against the float64 truth over the largest error of the legitimate same-dtype computations of the same rows
(the reference, its decoy-company variants, and the spec at the same layout, which rounds the TP partials
the way the layout legitimately does), tested against 0 over the run.

Examples are drawn for evidence, not for corner cases (test_parity.py's job): every DP rank busy, several
requests of several tokens each, and prefixes that are either short or long (64-200 positions: RoPE
faults grow with the position, and the catalog's other strategies stay below 11). Every example is still
judged by all of checks.parity's checks; the pooled test runs once the search is over.
"""
from __future__ import annotations

import uuid

import pytest
from hypothesis import given, target
from hypothesis import strategies as st

from checks.batches import Batch, Request
from checks.numerics import PrecisionPool
from checks.parity import run_example
from checks.targets.protocol import known_failure, resolve, skip_reason
from fixtures.build import fixture_path
from fixtures.specs import FIXTURES
from property_tests import search
from property_tests.strategies import Example, layouts_for

HALF = ("bfloat16", "float16")
LONG = (64, 200)      # prefix lengths past bfloat16's exact integers' reach at hidden RoPE frequencies


@st.composite
def busy_batches(draw, dp: int) -> Batch:
    """Every DP rank extends 2-4 requests of 4-12 tokens after a short or a long prefix: at least 8 tokens
    per DP rank even in the simplest example hypothesis draws first."""
    def request():
        prefix = draw(st.one_of(st.integers(0, 4), st.integers(*LONG)))
        return Request(prefix, draw(st.integers(4, 12)))
    per = tuple(tuple(request() for _ in range(draw(st.integers(2, 4)))) for _ in range(dp))
    return Batch(per, draw(st.integers(0, 2**16)))


@st.composite
def precision_examples(draw, fixtures, world_sizes, dtypes, unit: str) -> Example:
    fixture = draw(st.sampled_from(sorted(fixtures)))
    layout = draw(st.sampled_from(layouts_for(fixture, world_sizes, with_dp_lm_head=(unit == "model"))))
    n_layers = FIXTURES[fixture].num_hidden_layers
    layer = 0 if unit == "model" else draw(st.integers(0, n_layers - 1))
    return Example(fixture, layout, draw(busy_batches(layout.dp)), draw(st.sampled_from(dtypes)), layer)


def check_precision(suite, unit: str):
    dtypes = [d for d in suite.dtypes if d in HALF]
    if not dtypes:
        pytest.skip(f"no half-precision dtype in --dtypes {','.join(suite.dtypes)}: in float32 the reference "
                    f"keeps every intermediate in the dtype itself, there is no precision class to test")
    tgt = resolve(suite.target)
    if unit not in tgt.units:
        pytest.skip(skip_reason(tgt, unit, None, None))
    pool = PrecisionPool()

    @given(data=st.data())
    def search_run(data):
        ex = data.draw(precision_examples(suite.fixtures, suite.world_sizes, dtypes, unit), label="example")
        res = run_example(suite.target, unit, str(fixture_path(ex.fixture)), ex.layout, ex.batch, ex.dtype,
                          ex.layer, suite.device, suite.deadline, build_id=uuid.uuid4().hex,
                          layout_reference=True)
        search.accept(unit, ex, res, known_failure(tgt, res, ex.fixture, ex.layer))
        assert res.ok, f"{res.report()}\nreplay: {ex.replay(unit, suite.target)}"
        if res.precision:
            mean = sum(res.precision) / len(res.precision)
            target(mean, label=f"{unit}: mean log energy ratio")   # climb toward the largest excess
            pool.add(f"{ex.replay(unit, suite.target)} --precision", res.precision)

    search_run.__name__ = f"test_{unit}_precision"
    search.floor(search_run)()
    v = pool.verdict()
    print(f"{unit} precision: mean log energy ratio {v.mean:+.3f} over {v.tokens} tokens of {v.examples} examples, "
          f"z={v.z:.1f} {v.reason}")
    assert v.ok, f"[precision] {v.reason}"


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
