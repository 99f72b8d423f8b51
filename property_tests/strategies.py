"""Hypothesis strategies: fixtures, layouts, batches (idle ranks included) and dtypes.

Everything shrinks toward the simplest failing case: sampled_from lists are ordered small-first (world
size, then dp, then ep), batch sizes shrink toward one token, idle ranks toward none.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import Layout, layouts_for
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.fixtures.specs import FIXTURES


@dataclass(frozen=True)
class Example:
    fixture: str
    layout: Layout
    batch: Batch
    dtype: str
    layer: int = 0

    def replay(self, unit: str, target: str) -> str:
        return (f"dpep replay --target {target} --unit {unit} --fixture {self.fixture} "
                f"--layout {self.layout} --dtype {self.dtype} --layer {self.layer} "
                f"--batch '{self.batch.describe()}'")


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


# ------------------------------------------------------------------ invariance pairs (checks/judge/invariance.py)
@st.composite
def probe_requests(draw):
    """The compared request: extending (after a cached prefix or not) or decoding, shrinking to one token."""
    from dpep_parity.checks.judge.invariance import PROBE
    if draw(st.booleans()):
        return Request(draw(st.integers(1, 6)), 1, PROBE)
    return Request(draw(st.integers(0, 4)), draw(st.integers(1, 5)), PROBE)


def _streams(reqs, first: int) -> tuple[Request, ...]:
    return tuple(Request(r.prefix, r.extend, first + i) for i, r in enumerate(reqs))


def _with(reqs: tuple[Request, ...], probe: Request, at: int) -> tuple[Request, ...]:
    at = min(at, len(reqs))
    return reqs[:at] + (probe,) + reqs[at:]


@st.composite
def invariance_pairs(draw, fixtures, world_sizes, dtypes, unit: str, kind: str):
    """Two contexts of one request (checks.judge.invariance.Pair), shrinking toward the request alone beside the
    smallest difference. batch: the same DP rank and the same other ranks, other requests co-batched with it
    (none, others, in another order: each context draws its own); placement: the same requests beside it on
    its rank, another DP rank, the other ranks idle, extending or decoding (SUM_LEN and MAX_LEN) as each
    context draws them. Requests other than the compared one keep their contents (streams) only where both
    contexts share them."""
    from dpep_parity.checks.judge.invariance import Context, Pair
    fixture = draw(st.sampled_from(sorted(fixtures)))
    lays = [lay for lay in layouts_for(fixture, world_sizes, with_dp_lm_head=units.get(unit).whole_model)
            if kind != "placement" or lay.dp > 1]
    if not lays:
        from hypothesis import reject
        reject()
    layout = draw(st.sampled_from(lays), label="layout")
    dtype = draw(st.sampled_from(list(dtypes)))
    n_layers = FIXTURES[fixture].num_hidden_layers
    layer = 0 if units.get(unit).whole_model else draw(st.integers(0, n_layers - 1))
    probe = draw(probe_requests(), label="request")
    seed = draw(st.integers(0, 2**16))
    dp = layout.dp
    modes = st.sampled_from(["idle", "extend", "decode"])
    if kind == "batch":
        d = draw(st.integers(0, dp - 1), label="its DP rank")
        others = [_streams(draw(rank_requests(draw(modes))), 200 + 10 * r) for r in range(dp)]
        mine = [_streams(draw(rank_requests(draw(modes))), 100 + 10 * c) for c in range(2)]
        per = [[list(o) for o in others] for _ in range(2)]
        for c in range(2):
            per[c][d] = _with(mine[c], probe, draw(st.integers(0, 2)))
    else:
        beside = _streams(draw(rank_requests(draw(modes))), 100)
        per = []
        for c in range(2):
            d = draw(st.integers(0, dp - 1), label=f"its DP rank in context {'AB'[c]}")
            ranks = [_streams(draw(rank_requests(draw(modes))), 200 + 10 * r + 100 * c) for r in range(dp)]
            ranks[d] = _with(beside, probe, 0)
            per.append(ranks)
    a, b = (Context(layout, Batch(tuple(tuple(x) for x in p), seed)) for p in per)
    return Pair(fixture, unit, dtype, layer, a, b)


@st.composite
def layout_pairs(draw, fixtures, world_sizes, dtypes, unit: str, groups_of):
    """The same request (and what is co-batched with it on DP rank 0; other DP ranks idle) under two layouts
    the target claims equal (`groups_of(config)`: checks.judge.invariance.layout_groups), shrinking to the request
    alone under the first two layouts of a group."""
    from dpep_parity.checks.core.topology import valid_layouts
    from dpep_parity.checks.judge.invariance import Context, Pair
    options = []
    for f in sorted(fixtures):
        cfg = fixture_config(f)
        valid = set(valid_layouts(1, cfg)) | {lay for ws in world_sizes for lay in valid_layouts(ws, cfg)}
        for g in groups_of(cfg):
            lays = [lay for lay in g if lay.tp in world_sizes and lay in valid]
            if len(lays) >= 2:
                options.append((f, tuple(lays)))
    if not options:
        from hypothesis import reject
        reject()
    fixture, lays = draw(st.sampled_from(options), label="fixture and claimed layouts")
    i = draw(st.integers(0, len(lays) - 2))
    j = draw(st.integers(i + 1, len(lays) - 1))
    dtype = draw(st.sampled_from(list(dtypes)))
    layer = 0 if units.get(unit).whole_model else draw(st.integers(0, FIXTURES[fixture].num_hidden_layers - 1))
    probe = draw(probe_requests(), label="request")
    beside = _with(_streams(draw(rank_requests(draw(st.sampled_from(["idle", "extend", "decode"])))), 100),
                   probe, draw(st.integers(0, 2)))
    seed = draw(st.integers(0, 2**16))

    def ctx(lay):
        return Context(lay, Batch((beside,) + ((),) * (lay.dp - 1), seed))
    return Pair(fixture, unit, dtype, layer, ctx(lays[i]), ctx(lays[j]))
