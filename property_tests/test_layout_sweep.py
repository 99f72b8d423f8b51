"""Every valid layout of 1, 2 and 4 ranks of every fixture: the MoE block, the decoder layer and the
model's logits agree with the oracle in fp32 and bf16, on a batch with an idle DP rank whenever dp > 1.
A deterministic complement to the hypothesis search, which samples layouts."""
from __future__ import annotations

import pytest

from checks.batches import Batch
from checks.batches import Request as R
from checks.parity import run_example
from checks.targets.protocol import known_failure, resolve
from fixtures.build import fixture_path
from fixtures.specs import FIXTURES
from property_tests.strategies import Example, layouts_for

CASES = [(f, lay) for f in sorted(FIXTURES) for lay in layouts_for(f, (1, 2, 4))]


def sweep_batch(dp: int) -> Batch:
    """dp 0 extends two requests (one after a prefix), dp 1 idles, the rest decode."""
    per = [(R(0, 3), R(2, 2))] + [() if d == 1 else (R(3, 1), R(1, 1)) for d in range(1, dp)]
    return Batch(tuple(per), seed=11 + dp)


@pytest.mark.parametrize("fixture,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_every_layout(suite, fixture, layout):
    if fixture not in suite.fixtures or layout.tp not in suite.world_sizes:
        pytest.skip("outside this run's --models / --world-sizes")
    target = resolve(suite.target)
    failures, known = [], []
    for unit in ("moe", "decoder", "model"):
        if unit not in target.units:
            continue
        for dtype in ("float32", "bfloat16"):
            ex = Example(fixture, layout, sweep_batch(layout.dp), dtype, layer=1 if unit != "model" else 0)
            res = run_example(suite.target, unit, str(fixture_path(fixture)), layout, ex.batch, dtype, ex.layer,
                              suite.device, suite.deadline)
            if res.skipped:
                continue
            if not res.ok:
                text = f"{res.report()}\nreplay: {ex.replay(unit, suite.target)}"
                why = known_failure(target, res, fixture, ex.layer)
                (known if why else failures).append(f"{why}\n{text}" if why else text)
    assert not failures, "\n\n".join(failures)
    if known:
        pytest.xfail("\n\n".join(known))
