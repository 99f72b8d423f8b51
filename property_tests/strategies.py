"""Hypothesis strategies: fixtures, layouts, batches (idle ranks included) and dtypes.

Everything shrinks toward the simplest failing case: sampled_from lists are ordered small-first (world
size, then dp, then ep), batch sizes shrink toward one token, idle ranks toward none.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from dpep_parity.checks import units
from dpep_parity.checks.batches import Batch, Request
from dpep_parity.checks.topology import Layout, valid_layouts
from dpep_parity.fixtures.specs import FIXTURES, fixture_config


@dataclass(frozen=True)
class Example:
    fixture: str
    layout: Layout
    batch: Batch
    dtype: str
    layer: int = 0

    def replay(self, unit: str, target: str) -> str:
        return (f"python -m checks.replay --target {target} --unit {unit} --fixture {self.fixture} "
                f"--layout {self.layout} --dtype {self.dtype} --layer {self.layer} "
                f"--batch '{self.batch.describe()}'")


def layouts_for(fixture: str, world_sizes, with_dp_lm_head: bool = False) -> list[Layout]:
    cfg = fixture_config(fixture)
    out = []
    for ws in sorted(world_sizes):
        out += valid_layouts(ws, cfg, dp_lm_head=with_dp_lm_head)
    return out


@st.composite
def rank_requests(draw, mode: str) -> tuple[Request, ...]:
    if mode == "idle":
        return ()
    if mode == "decode":
        n = draw(st.integers(1, 3))
        return tuple(Request(draw(st.integers(1, 6)), 1) for _ in range(n))
    n = draw(st.integers(1, 2))
    return tuple(Request(draw(st.integers(0, 4)), draw(st.integers(1, 6))) for _ in range(n))


@st.composite
def batches(draw, dp: int, allow_all_idle: bool = True) -> Batch:
    """Per DP rank a forward mode (extend / decode / idle) and its requests. Decode-only batches reach the
    MAX_LEN padding mode; idle ranks are drawn often because they are where collectives get skipped."""
    modes = draw(st.lists(st.sampled_from(["extend", "idle", "decode"]), min_size=dp, max_size=dp))
    if not allow_all_idle and all(m == "idle" for m in modes):
        modes[0] = "extend"
    per = tuple(draw(rank_requests(m)) for m in modes)
    return Batch(per, draw(st.integers(0, 2**16)))


@st.composite
def examples(draw, fixtures, world_sizes, dtypes, unit: str) -> Example:
    fixture = draw(st.sampled_from(sorted(fixtures)))
    lays = layouts_for(fixture, world_sizes, with_dp_lm_head=units.get(unit).whole_model)
    layout = draw(st.sampled_from(lays))
    batch = draw(batches(layout.dp))
    dtype = draw(st.sampled_from(list(dtypes)))
    n_layers = FIXTURES[fixture].num_hidden_layers
    layer = 0 if units.get(unit).whole_model else draw(st.integers(0, n_layers - 1))
    return Example(fixture, layout, batch, dtype, layer)
