"""Every valid layout of 1, 2 and 4 ranks of every fixture, every unit (MoE block, attention, decoder layer,
model logits; the model with dp-lm-head too where it is valid), in the run's --dtypes, on two steps:
- an extend step: DP rank 0 extends two requests (one after a cached prefix), DP rank 1 idles, the rest
  decode (SUM_LEN padding: some rank extends);
- a decode-only step with uneven counts and an idle DP rank: DP rank 0 decodes three requests and rank 1
  idles (dp 2), or ranks decode 3, 1, 0 and 2 requests (dp 4): MAX_LEN padding whenever dp > 1, the idle
  rank padded to three rows (the decode-only faults M07 and M08 live there);
- (dp > 1) a decode-only step with DP rank 0 idle and rank 1 the busiest (0, 3 at dp 2: MAX_LEN by the tie
  rule; 0, 3, 1, 0 at dp 4: a decode-only SUM_LEN step): every DP rank is busy in one step and idle in another. A case stops at its first unexplained failure.
A deterministic complement to the hypothesis search, which samples layouts and batches."""
from __future__ import annotations

from dataclasses import replace

import pytest

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import MAX_LEN, SUM_LEN, Batch, padding_mode
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.protocol import UNITS, known_failure, resolve
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.specs import DEFAULT_SUITE, FIXTURES
from dpep_parity.property_tests.strategies import Example, layouts_for

CASES = [(f, lay) for f in sorted(DEFAULT_SUITE) for lay in layouts_for(f, (1, 2, 4))]


def pytest_generate_tests(metafunc):
    """The sweep's cases are the run's fixtures (--models, else the default suite), so a fixture outside the
    default suite (MiniMax-M2, GPT-OSS) is swept when named; an unknown name is the suite option's error."""
    if "layout" in metafunc.fixturenames and "fixture" in metafunc.fixturenames:
        named = [f for f in metafunc.config.getoption("--models").split(",") if f] or sorted(DEFAULT_SUITE)
        cases = [(f, lay) for f in sorted(set(named)) if f in FIXTURES for lay in layouts_for(f, (1, 2, 4))]
        metafunc.parametrize("fixture,layout", [pytest.param(f, lay, id=f"{f}-{lay}", marks=tier(lay))
                                                for f, lay in cases])


def tier(layout) -> tuple:
    """The repository's quick tier (checks/suite/tiers.py) sweeps one device and every layout with data-parallel
    attention; the layouts of several ranks without it (TP and EP only) are in the slow tier, which CI also
    runs. An engine's repository running this module has no tiers: it sweeps every layout."""
    return (pytest.mark.slow,) if layout.dp == 1 and layout.tp > 1 else ()


def extend_step(dp: int) -> Batch:
    per = [(R(0, 3), R(2, 2))] + [() if d == 1 else (R(3, 1), R(1, 1)) for d in range(1, dp)]
    return Batch(tuple(per), seed=11 + dp)


def decode_step(dp: int) -> Batch:
    counts = [3, 0] if dp == 2 else [3, 1, 0, 2][:dp]
    return Batch(tuple(tuple(R(2 + i, 1) for i in range(c)) for c in counts), seed=21 + dp)


def shifted_decode_step(dp: int) -> Batch:
    """A decode-only step whose idle ranks are the ones the other two steps keep busy (DP rank 0 among them)
    and whose busiest rank is above 0: with it every DP rank is busy in one step and idle in another at every
    dp, so a fault that corrupts only a busy DP rank > 0 shows at dp = 2 too."""
    counts = [0, 3] if dp == 2 else [0, 3, 1, 0][:dp]
    return Batch(tuple(tuple(R(3 + i, 1) for i in range(c)) for c in counts), seed=31 + dp)


def steps(dp: int) -> tuple[Batch, ...]:
    return (extend_step(dp), decode_step(dp)) + ((shifted_decode_step(dp),) if dp > 1 else ())


def unit_layouts(layout, unit: str) -> list:
    """The layouts a unit is swept on: the model also with its lm_head over the attention-TP group."""
    return [layout, replace(layout, dp_lm_head=True)] if units.get(unit).whole_model and layout.dp > 1 else [layout]


def test_sweep_reaches_both_padding_modes_an_idle_rank_and_dp_lm_head():
    assert padding_mode(extend_step(2)) == padding_mode(extend_step(4)) == SUM_LEN
    assert padding_mode(decode_step(2)) == padding_mode(decode_step(4)) == MAX_LEN
    for dp in (2, 4):
        for b in (extend_step(dp), decode_step(dp)):
            assert 0 in b.tokens_per_dp() and not b.nobody_runs        # an idle DP rank in both steps
    assert {lay.dp for _, lay in CASES} == {1, 2, 4}
    assert [lay.dp_lm_head for lay in unit_layouts(Layout(2, 2, 1), "model")] == [False, True]
    # the shifted step: a tie at dp 2 (MAX_LEN by default), a decode-only SUM_LEN step at dp 4
    assert (padding_mode(shifted_decode_step(2)), padding_mode(shifted_decode_step(4))) == (MAX_LEN, SUM_LEN)


@pytest.mark.parametrize("dp", [2, 4])
def test_every_dp_rank_is_busy_in_some_step_and_idle_in_another(dp):
    busy = [[c > 0 for c in b.tokens_per_dp()] for b in steps(dp)]
    for rank in range(dp):
        assert any(step[rank] for step in busy) and not all(step[rank] for step in busy), (dp, rank, busy)


def test_every_layout(suite, fixture, layout):
    if fixture not in suite.fixtures or layout.tp not in suite.world_sizes:
        pytest.skip("outside this run's --models / --world-sizes")
    target = resolve(suite.target)
    known, ran = [], 0
    todo = [(unit, lay, batch, dtype) for unit in UNITS if unit in target.units
            for lay in unit_layouts(layout, unit) for batch in steps(layout.dp) for dtype in suite.dtypes]
    for unit, lay, batch, dtype in todo:
        ex = Example(fixture, lay, batch, dtype, layer=1 if unit != "model" else 0)
        res = run_example(suite.target, unit, str(fixture_path(fixture)), lay, batch, dtype, ex.layer,
                          suite.device, suite.deadline)
        if res.skipped:
            continue
        ran += 1
        if not res.ok:
            text = f"{res.report()}\nreplay: {ex.replay(unit, suite.target)}"
            why = known_failure(target, res, fixture, ex.layer)
            if not why:   # the case's verdict is known: stop rather than spend the rest of its examples
                pytest.fail(f"{text}\n(stopped at this example, {ran} of the case's {len(todo)} examples run"
                            + (f"; {len(known)} known failure(s) before it" if known else "") + ")",
                            pytrace=False)
            known.append(f"{why}\n{text}")
    if known:
        pytest.xfail("\n\n".join(known))
    if not ran:
        pytest.skip(f"target {target.name} skipped every example of this layout")
