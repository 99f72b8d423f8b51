"""Invariance: one request's outputs, bitwise, in two contexts. No float64 oracle is needed: the property is
metamorphic (the same request, its contents fixed by its `stream`, placed in another batch, on another DP rank
or under another layout must give the same bits).

- batch:     the same DP rank, other requests co-batched with it (other sizes, orders, prefixes);
- placement: another DP rank, the other ranks idle, busy or padded (SUM_LEN and MAX_LEN);
- layout:    another layout, where the target names the layouts it claims equal.

A target promises what it declares (`invariances`, docs/targets.md): a broken promise fails. For a target that
promises nothing the suite measures the drift (rows of the request that change, their largest difference in
ULPs of the dtype) and reports it as information. A context that crashes or hangs has no verdict here (the
parity properties judge crashes): the pair is reported as such.

    python -m checks.judge.invariance pair --target spec --unit moe --fixture qwen3-moe --dtype float32 --layer 1 \\
        --layout tp2-dp2-ep1 --batch 'dp0:0+3@900 dp1:idle seed=1' --against 'dp0:idle dp1:0+3@900,0+2@1 seed=1'
    python -m checks.judge.invariance drift --target spec --world-sizes 1,2 --dtypes float32   # the drift table
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import DTYPES, Batch, Request, padding_mode, parse_batch
from dpep_parity.checks.core.topology import Layout

KINDS = ("batch", "placement", "layout")
PROBE = 900          # the stream of the request whose outputs are compared (others get 0, 1, ...)


def claims(target) -> frozenset[str]:
    """The invariances a target promises (`invariances`), checked against KINDS."""
    promised = frozenset(getattr(target, "invariances", ()) or ())
    unknown = promised - set(KINDS)
    if unknown:
        raise ValueError(f"target {getattr(target, 'name', target)!r} promises unknown invariances "
                         f"{sorted(unknown)}: one of {', '.join(KINDS)}")
    return promised


def layout_groups(target, config: dict) -> list[tuple[Layout, ...]]:
    """The groups of layouts the target claims give the same bits on a model of this config
    (`invariant_layouts`: groups of layout names, or a function of the config returning them)."""
    if "layout" not in claims(target):
        return []
    groups = getattr(target, "invariant_layouts", ()) or ()
    if callable(groups):
        groups = groups(config)
    return [tuple(Layout.parse(t) if isinstance(t, str) else t for t in g) for g in groups]


@dataclass(frozen=True)
class Context:
    layout: Layout
    batch: Batch

    def where(self, stream: int) -> tuple[int, int]:
        """(DP rank, index within it) of the request with that stream."""
        for d, reqs in enumerate(self.batch.per_dp):
            for i, r in enumerate(reqs):
                if r.stream == stream:
                    return d, i
        raise ValueError(f"no request with stream {stream} in {self.batch.describe()}")

    def describe(self) -> str:
        mode = padding_mode(self.batch) if self.layout.dp > 1 else None
        return f"{self.layout} [{self.batch.describe()}]" + (f" ({mode})" if mode else "")


@dataclass(frozen=True)
class Pair:
    fixture: str
    unit: str
    dtype: str
    layer: int
    a: Context
    b: Context
    stream: int = PROBE

    @property
    def kind(self) -> str:
        """layout: the layouts differ; batch: the request stays on its DP rank and only what is co-batched
        with it there differs; placement: it moves to another DP rank, or the other DP ranks' work differs."""
        if self.a.layout != self.b.layout:
            return "layout"
        (da, _), (db, _) = self.a.where(self.stream), self.b.where(self.stream)
        others = [tuple(c.batch.per_dp[d] for d in range(c.batch.dp) if d != da) for c in (self.a, self.b)]
        return "batch" if da == db and others[0] == others[1] else "placement"

    def replay(self, target: str) -> str:
        cmd = (f"dpep invariance pair --target {target} --unit {self.unit} --fixture {self.fixture} "
               f"--dtype {self.dtype} --layer {self.layer} --layout {self.a.layout} --batch '{self.a.batch.describe()}'")
        if self.b.layout != self.a.layout:
            cmd += f" --against-layout {self.b.layout}"
        return cmd + f" --against '{self.b.batch.describe()}' --request {self.stream}"


@dataclass
class Drift:
    pair: Pair
    rows: int = 0                 # the request's output rows
    changed: int = 0              # rows with any element not bitwise equal
    max_ulp: float = 0.0          # the largest difference, in ULPs of the dtype at its row's largest element
    unjudged: str = ""            # a context that did not run: why

    @property
    def equal(self) -> bool:
        return not self.unjudged and self.changed == 0

    def report(self) -> str:
        p = self.pair
        head = f"{p.kind} invariance, {p.unit} {p.fixture} {p.dtype} layer {p.layer}, request @{p.stream}"
        if self.unjudged:
            return f"{head}: not judged: {self.unjudged}"
        verdict = "identical" if self.equal else f"{self.changed}/{self.rows} rows differ, max {self.max_ulp:.1f} ulp"
        return f"{head}: {verdict}\n  A: {p.a.describe()}\n  B: {p.b.describe()}"


class ContextFailed(RuntimeError):
    pass


def request_rows(target: str, unit: str, model_dir: str, ctx: Context, dtype: str, layer: int, stream: int,
                 device: str = "cpu", deadline_s: float = 120.0) -> torch.Tensor:
    """The output rows of the request with `stream` in context `ctx`, from every rank of its DP rank (they must
    agree bitwise: ranks of one attention-TP group return the same rows)."""
    from dpep_parity.checks.harness.unitjob import UnitJob
    from dpep_parity.checks.harness.world import WorldFailure, get_world
    d, i = ctx.where(stream)
    from dpep_parity.checks.targets.protocol import resolve
    world = get_world(ctx.layout.tp, device, deadline_s, preload=getattr(resolve(target), "preload_modules", ()))
    try:
        results = world.run(UnitJob(target, unit, model_dir, ctx.layout, ctx.batch, dtype, layer))
    except WorldFailure as e:
        raise ContextFailed(f"{ctx.describe()}: {e.kind}: {str(e).splitlines()[0] if str(e) else ''}") from None
    key = units.get(unit).output
    reqs = ctx.batch.per_dp[d]
    start = sum(r.extend for r in reqs[:i])
    rows = [r.value[key][start: start + reqs[i].extend] for r in results if ctx.layout.dp_rank(r.rank) == d]
    if any(not torch.equal(rows[0], x) for x in rows[1:]):
        raise ContextFailed(f"{ctx.describe()}: the ranks of DP rank {d} returned different rows for request "
                            f"@{stream} (an ownership failure: the parity properties judge it)")
    return rows[0]


def measure(pair: Pair, target: str, model_dir: str, device: str = "cpu", deadline_s: float = 120.0) -> Drift:
    drift = Drift(pair)
    try:
        ya, yb = (request_rows(target, pair.unit, model_dir, c, pair.dtype, pair.layer, pair.stream, device,
                               deadline_s) for c in (pair.a, pair.b))
    except ContextFailed as e:
        drift.unjudged = str(e)
        return drift
    if ya.shape != yb.shape:
        drift.unjudged = f"the request's outputs have shapes {tuple(ya.shape)} and {tuple(yb.shape)}"
        return drift
    same = (ya == yb) | (torch.isnan(ya) & torch.isnan(yb))
    drift.rows, drift.changed = ya.shape[0], int((~same.all(dim=-1)).sum()) if ya.numel() else 0
    if drift.changed:
        from dpep_parity.checks.core.numerics import ulp
        dt = DTYPES[pair.dtype]
        diff = (ya.double() - yb.double()).abs()
        # in ULPs of the row's largest element: an element near zero after cancellation would otherwise
        # read a one-ulp change of its summands as thousands of its own ulps
        rowmax = torch.maximum(ya.double().abs().amax(-1, keepdim=True), yb.double().abs().amax(-1, keepdim=True))
        drift.max_ulp = float(torch.nan_to_num(diff / ulp(rowmax, dt), nan=float("inf"))[~same].max())
    return drift


# ------------------------------------------------------------------ the run's drift log
DRIFT_LOG = "DPEP_DRIFT_LOG"     # a JSON-lines file the property tests append to (set by the pytest plugin)


def log_drift(d: Drift) -> None:
    """Append a judged pair's drift to the run's log (every xdist worker inherits the controller's path)."""
    import json
    import os
    path = os.environ.get(DRIFT_LOG)
    if not path or d.unjudged:
        return
    p = d.pair
    with open(path, "a") as f:
        f.write(json.dumps({"unit": p.unit, "layout": str(p.a.layout), "dtype": p.dtype, "kind": p.kind,
                            "rows": d.rows, "changed": d.changed, "max_ulp": d.max_ulp}) + "\n")


def table_of_log(path: str) -> Table:
    import json
    t = Table()
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            t.add_record(r)
    return t


# ------------------------------------------------------------------ contexts
def with_probe(batch: Batch, dp_rank: int, probe: Request, at: int) -> Batch:
    """`batch` with the probe request inserted on `dp_rank` at position `at`, the other requests given streams
    0, 1, ... in global order (their contents, fixed across the pair's contexts)."""
    per = [list(reqs) for reqs in batch.per_dp]
    per[dp_rank].insert(min(at, len(per[dp_rank])), probe)
    n = 0
    out = []
    for reqs in per:
        row = []
        for r in reqs:
            if r is probe:
                row.append(r)
            else:
                row.append(Request(r.prefix, r.extend, n))
                n += 1
        out.append(tuple(row))
    return Batch(tuple(out), batch.seed)


def alone(dp: int, dp_rank: int, probe: Request, seed: int) -> Batch:
    return Batch(tuple((probe,) if d == dp_rank else () for d in range(dp)), seed)


def standard_pairs(fixture: str, unit: str, dtype: str, layer: int, layout: Layout, seed: int = 1) -> list[Pair]:
    """The drift table's pairs at one layout: an extending request alone and co-batched on the same rank
    (batch), alone on DP rank 0 and on the last DP rank with every other rank extending (placement, SUM_LEN),
    and a decoding request alone and beside ranks decoding more requests (MAX_LEN padding to a longer slot)."""
    ext = Request(2, 3, PROBE)
    dec = Request(4, 1, PROBE)
    dp = layout.dp
    pairs = [Pair(fixture, unit, dtype, layer, Context(layout, alone(dp, 0, ext, seed)),
                  Context(layout, with_probe(Batch(tuple(((Request(0, 4), Request(3, 2)) if d == 0 else ())
                                                         for d in range(dp)), seed), 0, ext, 1)))]
    if dp > 1:
        busy = Batch(tuple((Request(1, 2),) if d < dp - 1 else (Request(0, 5),) for d in range(dp)), seed)
        pairs.append(Pair(fixture, unit, dtype, layer, Context(layout, alone(dp, 0, ext, seed)),
                          Context(layout, with_probe(busy, dp - 1, ext, 0))))
        decoders = Batch(tuple(tuple(Request(3, 1) for _ in range(3)) for _ in range(dp)), seed)
        pairs.append(Pair(fixture, unit, dtype, layer, Context(layout, alone(dp, 0, dec, seed)),
                          Context(layout, with_probe(decoders, 0, dec, 1))))
    return pairs


@dataclass
class Table:
    """Drift per (unit, layout): pairs judged, pairs with any changed row, rows changed / rows, max ULP.
    `by="world"`: layouts of one world size in one row."""
    cells: dict = field(default_factory=dict)
    by: str = "layout"

    def add(self, d: Drift) -> None:
        self.add_record({"unit": d.pair.unit, "layout": str(d.pair.a.layout), "dtype": d.pair.dtype,
                         "rows": d.rows, "changed": d.changed, "max_ulp": d.max_ulp, "unjudged": bool(d.unjudged)})

    def add_record(self, r: dict) -> None:
        where = r["layout"] if self.by == "layout" else f"tp{Layout.parse(r['layout']).tp} (every layout)"
        c = self.cells.setdefault((r["unit"], where, r["dtype"]), {
            "pairs": 0, "drifted": 0, "rows": 0, "changed": 0, "max_ulp": 0.0, "unjudged": 0})
        if r.get("unjudged"):
            c["unjudged"] += 1
            return
        c["pairs"] += 1
        c["drifted"] += int(r["changed"] > 0)
        c["rows"] += r["rows"]
        c["changed"] += r["changed"]
        c["max_ulp"] = max(c["max_ulp"], r["max_ulp"])

    def markdown(self) -> str:
        lines = ["| unit | layout | dtype | pairs drifted | rows changed | max ULP (of the row's largest) | not judged |",
                 "|---|---|---|---|---|---|---|"]
        for (unit, lay, dt), c in sorted(self.cells.items()):
            lines.append(f"| {unit} | {lay} | {dt} | {c['drifted']}/{c['pairs']} | {c['changed']}/{c['rows']} | "
                         f"{c['max_ulp']:.1f} | {c['unjudged']} |")
        return "\n".join(lines)


# ------------------------------------------------------------------ command line
def main(argv=None) -> int:
    from dpep_parity.progname import prog
    ap = argparse.ArgumentParser(prog=prog("python -m checks.judge.invariance"), description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pair", help="replay one pair of contexts (as printed by a failing invariance property)")
    p.add_argument("--target", default="spec")
    p.add_argument("--unit", required=True, choices=units.UNITS)
    p.add_argument("--fixture", required=True)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--layout", required=True, type=Layout.parse)
    p.add_argument("--batch", required=True, type=parse_batch)
    p.add_argument("--against-layout", type=Layout.parse, default=None)
    p.add_argument("--against", required=True, type=parse_batch)
    p.add_argument("--request", type=int, default=PROBE, help="the stream of the compared request")
    p.add_argument("--device", default="cpu")
    p.add_argument("--deadline", type=float, default=120.0)
    t = sub.add_parser("drift", help="the drift table of a target: standard pairs per unit and layout")
    t.add_argument("--target", default="spec")
    t.add_argument("--models", default="")
    t.add_argument("--units", default=",".join(units.UNITS))
    t.add_argument("--world-sizes", default="1,2")
    t.add_argument("--dtypes", default="float32")
    t.add_argument("--device", default="cpu")
    t.add_argument("--deadline", type=float, default=120.0)
    t.add_argument("--by", choices=("layout", "world"), default="layout", help="a row per layout or per world size")
    a = ap.parse_args(argv)
    from dpep_parity.fixtures.build import fixture_path
    if a.cmd == "pair":
        pair = Pair(a.fixture, a.unit, a.dtype, a.layer, Context(a.layout, a.batch),
                    Context(a.against_layout or a.layout, a.against), a.request)
        from dpep_parity.checks.core.batches import batch_problems
        from dpep_parity.fixtures.families import fixture_config
        bad = []
        for c in (pair.a, pair.b):      # usage errors before any rank starts
            try:
                c.where(a.request)
            except ValueError as e:
                bad.append(str(e))
            bad += batch_problems(c.batch, fixture_config(a.fixture), a.fixture)
            if c.batch.dp != c.layout.dp:
                bad.append(f"batch {c.batch.describe()!r} names {c.batch.dp} DP ranks, layout {c.layout} has "
                           f"dp={c.layout.dp}")
        if bad:
            ap.error("\n  ".join(["the pair cannot run:", *bad]))
        d = measure(pair, a.target, str(fixture_path(a.fixture)), a.device, a.deadline)
        print(d.report())
        print("IDENTICAL" if d.equal else "NOT JUDGED" if d.unjudged else "DRIFT")
        return 0 if d.equal else 3 if d.unjudged else 1
    return drift_table(a)


def drift_table(a) -> int:
    import time

    from dpep_parity.checks.core.topology import layouts_for
    from dpep_parity.checks.targets.protocol import resolve, skip_reason
    from dpep_parity.fixtures.build import fixture_path
    from dpep_parity.fixtures.families import fixture_config
    from dpep_parity.fixtures.specs import DEFAULT_SUITE
    tgt = resolve(a.target)
    fixtures = [f for f in a.models.split(",") if f] or sorted(DEFAULT_SUITE)
    sizes = [int(w) for w in a.world_sizes.split(",")]
    table, t0 = Table(by=a.by), time.perf_counter()
    for fixture in fixtures:
        model = str(fixture_path(fixture))
        for unit in [u for u in a.units.split(",") if u]:
            layer = 0 if units.get(unit).whole_model else 1
            for layout in layouts_for(fixture, sizes):
                if skip_reason(tgt, unit, fixture_config(fixture), layout):
                    continue
                for dtype in a.dtypes.split(","):
                    for pair in standard_pairs(fixture, unit, dtype, layer, layout):
                        d = measure(pair, a.target, model, a.device, a.deadline)
                        table.add(d)
                        print(f"[{time.perf_counter() - t0:6.0f}s] {d.report().splitlines()[0]}  ({layout})",
                              file=sys.stderr, flush=True)
    print(f"drift of target {a.target} ({', '.join(sorted(claims(tgt))) or 'promises no invariance'}), "
          f"fixtures {', '.join(fixtures)}:")
    print(table.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
