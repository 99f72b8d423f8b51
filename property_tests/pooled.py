"""The precision property's search and pooled verdict, shared by test_precision.py (tiny fixtures) and
test_gpu.py (production shapes): hypothesis draws the examples, every one is judged by all of checks.judge.parity's
checks, and their precision evidence is pooled into one verdict at the end of the search (checks/core/numerics.py,
"precision"; docs/precision.md). Hypothesis has no per-run reduction over examples, hence this wrapper."""
from __future__ import annotations

from hypothesis import given, settings, target
from hypothesis import strategies as st

from dpep_parity.checks.core.numerics import PrecisionPool
from dpep_parity.checks.core.records import FailedCheck, FailureRecord, PropertyFailure, expect
from dpep_parity.property_tests import search

HALF = ("bfloat16", "float16")


def pooled_precision(unit: str, strategy, run, known, replay, max_examples: int | None = None) -> None:
    """The search over `strategy`'s examples, each run by `run(ex)` (with the layout reference) and judged by
    every check of checks.judge.parity; then the pooled precision test over all of them (shared with the GPU tier).
    `known(res, ex)`: a written-up known failure or None; `replay(ex)`: the example's replay command."""
    pool = PrecisionPool()

    @given(data=st.data())
    def search_run(data):
        ex = data.draw(strategy, label="example")
        res = run(ex)
        search.accept(unit, ex, res, known(res, ex))
        expect(res, f"{res.report()}\nreplay: {replay(ex)}", replay(ex))
        if res.precision:
            mean = sum(res.precision) / len(res.precision)
            target(mean, label=f"{unit}: mean log energy ratio")   # climb toward the largest excess
            pool.add(f"{replay(ex)} --precision", res.precision)

    search_run.__name__ = f"test_{unit}_precision"
    if max_examples:
        search_run = settings(max_examples=max_examples)(search_run)
    search.floor(search_run)()
    v = pool.verdict()
    print(f"{unit} precision: mean log energy ratio {v.mean:+.3f} over {v.tokens} tokens of {v.examples} examples, "
          f"z={v.z:.1f} {v.reason}")
    if not v.ok:
        raise PropertyFailure(f"[precision] {v.reason}",
                              FailureRecord((FailedCheck("precision", v.reason),), unit=unit))
