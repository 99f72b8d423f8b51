"""One parity example end to end: run a unit of a target across a world, ask the oracle, judge.

The result holds every check as data so that properties (property_tests/) assert on it and the kill table
can say which check caught a mutant: output parity (tolerance model), exact row ownership / shapes /
dtypes, expert dispatch counts, the padding-mode rule, and collective discipline from the records.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field

import torch

from dpep_parity.checks import units
from dpep_parity.checks.core import numerics
from dpep_parity.checks.core.batches import DTYPES, MAX_LEN, Batch, padding_mode
from dpep_parity.checks.core.records import FailedCheck, FailureRecord
from dpep_parity.checks.core.topology import Layout, validate
from dpep_parity.checks.harness import gpus
from dpep_parity.checks.harness.recorder import mismatches
from dpep_parity.checks.harness.unitjob import UnitJob, load_weights
from dpep_parity.checks.harness.world import RankResult, WorldFailure, get_world
from dpep_parity.checks.judge import router_weights
from dpep_parity.checks.oracle.reference import Oracle, UnitRef
from dpep_parity.checks.targets.protocol import HarnessFault, padding_ties, resolve, skip_reason
from dpep_parity.fixtures import families
from dpep_parity.fixtures.families import sparse_layers


@dataclass
class Check:
    prop: str          # which property: "parity", "ownership", "dispatch", "padding-rule", "collectives", ...
    ok: bool
    message: str = ""


@dataclass
class ParityResult:
    unit: str
    layout: Layout
    batch: Batch
    dtype: str
    checks: list[Check] = field(default_factory=list)
    verdict: numerics.Verdict | None = None
    first_divergent_layer: int | None = None
    skipped: str | None = None
    precision: list[float] | None = None   # the precision test's evidence (numerics.precision_sample), if asked
    precision_note: str = ""               # why there is none, when asked for

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def failure_record(self, replay: str | None = None) -> FailureRecord:
        """The failed checks as a typed record (checks.core.records), for tools; `report()` is for people."""
        return FailureRecord(tuple(FailedCheck(c.prop, c.message) for c in self.failures()), unit=self.unit,
                             layout=str(self.layout), batch=self.batch.describe(), dtype=self.dtype, replay=replay)

    def report(self) -> str:
        lines = [f"{self.unit} {self.layout} {self.dtype} batch[{self.batch.describe()}]"]
        for c in self.failures():
            lines.append(f"[{c.prop}] {c.message}")
        if self.verdict is not None:
            lines.append(str(self.verdict))
        if self.first_divergent_layer is not None:
            lines.append(f"first divergent layer: {self.first_divergent_layer}")
        if self.precision:
            m = sum(self.precision) / len(self.precision)
            lines.append(f"precision evidence: mean log energy ratio {m:+.3f} over {len(self.precision)} tokens "
                         f"(judged pooled over a run: property_tests/test_precision.py)")
        elif self.precision_note:
            lines.append(f"precision evidence: none ({self.precision_note})")
        return "\n".join(lines)


def row_labels(batch: Batch, layout: Layout, ranks: list[int]) -> list[str]:
    out = []
    for r in ranks:
        d = layout.dp_rank(r)
        for i, req in enumerate(batch.per_dp[d]):
            out += [f"rank {r} (dp {d}) request {i} token {req.prefix + t}" for t in range(req.extend)]
    return out


def token_keys(batch: Batch, layout: Layout, ranks: list[int]) -> list[tuple]:
    """(dp rank, request, position) per output row: equal for the replicas of one token."""
    out = []
    for r in ranks:
        d = layout.dp_rank(r)
        for i, req in enumerate(batch.per_dp[d]):
            out += [(d, i, t) for t in range(req.extend)]
    return out


def oracle_rows(ref: torch.Tensor, batch: Batch, layout: Layout, ranks: list[int]) -> torch.Tensor:
    """The oracle's rows (global order) arranged as the concatenation of the given ranks' outputs."""
    counts = batch.tokens_per_dp()
    starts = _cumsum(counts)
    idx = []
    for r in ranks:
        d = layout.dp_rank(r)
        idx += range(starts[d], starts[d] + counts[d])
    return ref[torch.tensor(idx, dtype=torch.long)] if idx else ref[:0]


def oracle_mask(mask: torch.Tensor, batch: Batch, layout: Layout, ranks: list[int]) -> torch.Tensor:
    """A per-row mask over global rows, arranged like the ranks' outputs (oracle_rows for booleans)."""
    return oracle_rows(mask[:, None].to(torch.float64), batch, layout, ranks)[:, 0].bool()


@dataclass
class Routing:
    """Router near-ties and flips over the global extend rows (global order)."""
    excused: torch.Tensor        # rows a legitimate routing flip may change: excluded from element checks
    ref_flipped: torch.Tensor    # rows the reference itself routes unlike the truth: not rounding noise
    check: Check | None = None   # exact routing away from ties (when the target reports its routing)


def _propagate(mask_pos: torch.Tensor, req, model: bool) -> torch.Tensor:
    """Positions (prefix + extend) -> extend rows affected. Single-layer units: the row itself; a whole model:
    that token and every later token of its request (attention carries the change forward)."""
    out = torch.zeros(req.extend, dtype=torch.bool)
    if not model:
        return mask_pos[-req.extend:].clone() if req.extend else out
    hit = mask_pos.nonzero().flatten()
    if len(hit):
        out[max(int(hit[0]) - req.prefix, 0):] = True
    return out


def routing_analysis(results, uref: UnitRef, batch: Batch, layout: Layout, unit: str, layer: int,
                     config: dict, top_k: int, dtype) -> Routing:
    """With the target's reported routing, a near-tie row is excused only where the target really chose
    other experts than the float64 truth, and another choice away from a tie fails exactly (its rows are
    still judged, so their parity failure shows the size of the damage). Without it, every near-tie row is
    excused (the truth alone cannot tell whether it flipped)."""
    u = units.get(unit)
    whole = u.whole_model
    layer_ids = u.sparse_layers_run(sparse_layers(config), layer)
    per_dp = batch.tokens_per_dp()
    n, dp_start = sum(per_dp), _cumsum(per_dp)
    flat = batch.requests_flat()
    starts = _cumsum([req.extend for _, _, req in flat])      # each request's first row, global order
    reported = all(isinstance(r.value.get("routing"), dict) for r in results) and bool(layer_ids)
    excused = torch.zeros(n, dtype=torch.bool)
    ref_flipped = torch.zeros(n, dtype=torch.bool)
    bad: list[str] = []
    dp_rows = {d: [q for q, (dd, _, _) in enumerate(flat) if dd == d] for d in range(layout.dp)}
    for li, (truth_reqs, ref_reqs) in zip(layer_ids, uref.router):
        # every statistic here is per row: computed once over all requests' rows (prefix + extend positions),
        # then split per request (one call per request cost most of the judge's time: docs/gpu.md)
        lens = [pt.shape[0] for pt in truth_reqs]
        if not lens:
            continue
        p_truth, p_ref = torch.cat(truth_reqs), torch.cat(ref_reqs)
        ties_all = numerics.near_ties(p_truth, p_ref, top_k, dtype)
        t_all = p_truth.topk(top_k, dim=1).indices.sort(dim=1).values
        r_all = p_ref.topk(top_k, dim=1).indices.sort(dim=1).values
        if whole:
            _route_requests(li, list(zip(ties_all.split(lens), t_all.split(lens), r_all.split(lens))), results,
                            flat, starts, layout, dp_rows, reported, excused, ref_flipped, bad)
            continue
        # a single layer: a row's change stays in the row, so every request's extend rows are judged at once
        # (its last `extend` rows; a Python loop per request and rank cost half the judge at 4 ranks)
        ext = torch.tensor([i for acc, k, (_, _, req) in zip(_cumsum(lens), lens, flat)
                            for i in range(acc + k - req.extend, acc + k)], dtype=torch.long)
        ties, want = ties_all[ext], t_all[ext]
        ref_flipped |= (t_all != r_all).any(1)[ext]
        if not reported:
            excused |= ties
            continue
        sut_flip = torch.zeros(n, dtype=torch.bool)
        for r in results:
            d = layout.dp_rank(r.rank)
            lo, hi = dp_start[d], dp_start[d] + per_dp[d]
            if lo == hi:
                continue
            got = r.value["routing"].get(li, r.value["routing"].get(str(li)))
            if got is None or tuple(got.shape) != tuple(want[lo:hi].shape):
                # the messages name the request whose rows are missing: the per-request walk
                per_req = list(zip(ties_all.split(lens), t_all.split(lens), r_all.split(lens)))
                _route_rank(li, r, d, got, per_req, flat, starts, dp_rows, False, excused, sut_flip, bad)
                continue
            diff = (got.to(want.dtype) != want[lo:hi]).any(1)
            away = diff & ~ties[lo:hi]
            sut_flip[lo:hi] |= diff & ~away
            per_request: dict[int, int] = {}
            for row in away.nonzero().flatten().tolist():
                q = next(q for q in dp_rows[d] if starts[q] <= lo + row < starts[q] + flat[q][2].extend)
                if per_request.setdefault(q, 0) < 2:       # two tokens a request, as the per-request walk names
                    per_request[q] += 1
                    _away(bad, r.rank, li, d, flat[q], lo + row - starts[q], got[row], want[lo + row])
        excused |= sut_flip
    check = Check("routing", not bad, "; ".join(bad[:3])) if reported else None
    return Routing(excused, ref_flipped, check)


def _cumsum(xs: list[int]) -> list[int]:
    """Starts of consecutive spans of these lengths."""
    out, acc = [], 0
    for x in xs:
        out.append(acc)
        acc += x
    return out


def _away(bad: list[str], rank: int, li: int, d: int, flat_q, t: int, got, want) -> None:
    _, i, req = flat_q
    bad.append(f"rank {rank}: layer {li} dp {d} request {i} token {req.prefix + t} "
               f"routed to experts {got.tolist()}, one device to {want.tolist()}, "
               f"and the router is not near a tie there")


def _route_requests(li, per_req, results, flat, starts, layout, dp_rows, reported, excused, ref_flipped, bad):
    """routing_analysis for one sparse layer of a whole model, request by request: a change at a token
    propagates to the later tokens of its request (`_propagate`)."""
    n = len(excused)
    sut_flip = torch.zeros(n, dtype=torch.bool)
    for q, ((_, _, req), (ties, t_ids, r_ids)) in enumerate(zip(flat, per_req)):
        ref_flipped[starts[q]: starts[q] + req.extend] |= _propagate((t_ids != r_ids).any(1), req, True)
        if not reported:
            excused[starts[q]: starts[q] + req.extend] |= _propagate(ties, req, True)
        elif req.prefix:
            # prefix tokens' routing is not reported: a tie there may have flipped unseen
            excused[starts[q]: starts[q] + req.extend] |= _propagate(
                torch.cat([ties[: req.prefix], torch.zeros(req.extend, dtype=torch.bool)]), req, True)
    if not reported:
        return
    for r in results:
        got = r.value["routing"].get(li, r.value["routing"].get(str(li)))
        _route_rank(li, r, layout.dp_rank(r.rank), got, per_req, flat, starts, dp_rows, True, excused,
                    sut_flip, bad)
    for q, (_, _, req) in enumerate(flat):
        excused[starts[q]: starts[q] + req.extend] |= _propagate(
            torch.cat([torch.zeros(req.prefix, dtype=torch.bool), sut_flip[starts[q]: starts[q] + req.extend]]),
            req, True)


def _route_rank(li, r, d, got, per_req, flat, starts, dp_rows, whole, excused, sut_flip, bad) -> None:
    """One rank's reported routing of layer `li` against the truth's, request by request of its DP rank."""
    row = 0
    for q in dp_rows[d]:
        req = flat[q][2]
        ties, t_ids, _ = per_req[q]
        want = t_ids[-req.extend:] if req.extend else t_ids[:0]
        g = got[row: row + req.extend] if got is not None else None
        row += req.extend
        if g is None:
            bad.append(f"rank {r.rank}: reported no routing for sparse layer {li}")
            break
        if tuple(g.shape) != tuple(want.shape):
            bad.append(f"rank {r.rank}: layer {li} routing of dp {d} request {flat[q][1]} has shape "
                       f"{tuple(g.shape)}, expected {tuple(want.shape)}")
            continue
        diff = (g.to(want.dtype) != want).any(1)
        away = diff & ~ties[ties.shape[0] - req.extend:]        # not [-extend:]: a request may extend 0 rows
        if whole:
            # a token downstream of a legitimate flip at an earlier layer (or of a prefix tie) has other
            # inputs than one device's from then on: its routing may differ anywhere (its rows are
            # excused already); a 500-example bfloat16 fuzz run found one such token judged "away"
            away &= ~excused[starts[q]: starts[q] + req.extend]
        # only a flip at a near-tie is legitimate and excuses the row (and, in the model, the later
        # tokens it feeds); a flip away from a tie is a routing failure and its rows stay judged
        sut_flip[starts[q]: starts[q] + req.extend] |= diff & ~away
        for t in away.nonzero().flatten().tolist()[:2]:
            _away(bad, r.rank, li, d, flat[q], t, g[t], want[t])


def run_example(target: str, unit: str, model_dir: str, layout: Layout, batch: Batch, dtype: str,
                layer: int = 0, device: str = "cpu", deadline_s: float = 120.0,
                truth_device: str | None = None, poison: bool = False, build_id: str = "",
                layout_reference: bool = False) -> ParityResult:
    """`device`: where the ranks run ('cpu' | 'cuda' | 'auto'); the oracle's reference in the test dtype
    runs on the same kind of device (same kernels, same rounding), its float64 truth on `truth_device`
    (default: the same). `poison`: fresh allocations of the target hold NaN (checks.harness.poison); `build_id`: run
    on that build of the target (kept across calls with the same id: a sequence of forwards on one build).
    `layout_reference`: in a half-precision dtype, also run the spec at the same layout on the same world and
    keep the precision test's evidence in `res.precision` (the spec makes the layout's legitimate roundings)."""
    config, _ = load_weights(str(model_dir))
    validate(layout, config)
    res = ParityResult(unit, layout, batch, dtype)
    tgt = resolve(target)
    reason = skip_reason(tgt, unit, config, layout)
    if reason:
        res.skipped = reason
        return res
    if batch.nobody_runs:
        # the scheduler's rule: with every DP rank idle no forward runs at all, so none is sent
        res.skipped = "every DP rank is idle: the engine runs no forward, there is nothing to compare"
        return res
    world = get_world(layout.tp, device, deadline_s, preload=getattr(tgt, "preload_modules", ()))
    job = UnitJob(target, unit, str(model_dir), layout, batch, dtype, layer, poison=poison, build_id=build_id)
    truth_device = truth_device or os.environ.get("DPEP_TRUTH_DEVICE") or None
    try:
        results = world.run(job, meanwhile=prefetch_oracle(str(model_dir), dtype, world.rank_device, truth_device,
                                                           unit, layer, batch) if overlaps_oracle(world) else None)
    except WorldFailure as e:
        if e.kind == "harness":        # the target's glue does not fit the system: no verdict on it
            raise HarnessFault(f"{target}: the harness could not run this example (not a verdict on the "
                               f"target):\n{e}") from None
        res.checks.append(Check("liveness" if e.kind in ("hang", "deadline", "died") else "no-crash", False, str(e)))
        return res
    lay_ref = None
    if layout_reference:
        lay_ref, res.precision_note = _layout_reference(world, target, job, config)
    judge(res, results, config, model_dir, layer, device=world.rank_device, truth_device=truth_device,
          precision=layout_reference and not res.precision_note, layout_ref=lay_ref,
          padding_ties=padding_ties(tgt))
    return res


def _layout_reference(world, target: str, job: UnitJob, config: dict) -> tuple[list[RankResult] | None, str]:
    """The spec's outputs for the same example at the same layout (its own build), or why there are none."""
    if torch.finfo(DTYPES[job.dtype]).bits > 16:
        return None, f"{job.dtype}: the precision test is for half-precision dtypes"
    if target == "spec":
        return None, ""              # the target is the layout reference: its own outputs serve
    why = skip_reason(resolve("spec"), job.unit, config, job.layout)
    if why:
        return None, f"the spec skips this example: {why}"
    spec_job = dataclasses.replace(job, target="spec", poison=False, build_id=f"{job.build_id}~layout-reference")
    try:
        return world.run(spec_job), ""
    except WorldFailure as e:
        return None, f"the spec failed at this layout: {str(e).splitlines()[0]}"


@dataclass
class Evidence:
    """What the checks of one example read: the ranks' results, the oracle's outputs, and what earlier
    checks found (rows in global order, the routing analysis, the tolerance verdict)."""
    res: ParityResult
    results: list[RankResult]
    config: dict
    layer: int
    uref: UnitRef
    variants: list
    precision: bool = False
    layout_ref: list[RankResult] | None = None
    padding_ties: str = MAX_LEN
    sut: torch.Tensor | None = None
    truth: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    routing: Routing | None = None
    excused: torch.Tensor | None = None
    labels: list[str] = field(default_factory=list)

    @property
    def unit(self):
        return units.get(self.res.unit)

    @property
    def layout(self) -> Layout:
        return self.res.layout

    @property
    def dt(self) -> torch.dtype:
        return DTYPES[self.res.dtype]

    @property
    def top_k(self) -> int:
        return self.config.get("num_experts_per_tok", 1)


def check_collectives(ev: Evidence) -> Check:
    return collective_discipline(ev.results, ev.layout)


def check_ownership(ev: Evidence) -> Check:
    """Exact: each rank returns exactly its DP rank's rows, in the test dtype. Every later check reads the
    rows in global order, so a failure here ends the judging."""
    batch, layout, key = ev.res.batch, ev.layout, ev.unit.output
    own = []
    for r in ev.results:
        out = r.value.get(key)
        want = batch.tokens_per_dp()[layout.dp_rank(r.rank)]
        cols = ev.uref.truth.shape[1]
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (want, cols):
            own.append(f"rank {r.rank}: returned {_shape(out)}, owes ({want}, {cols}) for its DP rank's tokens")
        elif out.dtype != ev.dt:
            own.append(f"rank {r.rank}: dtype {out.dtype}, expected {ev.dt}")
    if not own:
        ranks = list(range(layout.tp))
        ev.sut = torch.cat([r.value[key] for r in ev.results])
        ev.truth, ev.ref = (oracle_rows(t, batch, layout, ranks) for t in (ev.uref.truth, ev.uref.ref))
        ev.routing = routing_analysis(ev.results, ev.uref, batch, layout, ev.res.unit, ev.layer, ev.config,
                                      ev.top_k, ev.dt)
        ev.excused = oracle_mask(ev.routing.excused, batch, layout, ranks)
        ev.labels = row_labels(batch, layout, ranks)
    return Check("ownership", not own, "; ".join(own))


def check_routing(ev: Evidence) -> Check | None:
    return ev.routing.check


def check_router_weights(ev: Evidence) -> Check | None:
    weights = router_weights.check(ev.results, ev.config,
                                   ev.unit.sparse_layers_run(sparse_layers(ev.config), ev.layer))
    return None if weights is None else Check("router", *weights)


def check_parity(ev: Evidence) -> Check:
    """The tolerance model on every row (numerics.compare), and the precision test's evidence if asked."""
    res, batch, layout, dt = ev.res, ev.res.batch, ev.layout, ev.dt
    ranks = list(range(layout.tp))
    noisy_ref = oracle_mask(ev.routing.ref_flipped, batch, layout, ranks)
    alts = [oracle_rows(a, batch, layout, ranks) for a in ev.variants]
    clusters = token_keys(batch, layout, ranks)
    v = numerics.compare(ev.unit.describe(ev.layer), ev.sut, ev.truth, ev.ref, dt, fan_in=layout.tp,
                         excused=ev.excused, labels=ev.labels, ref_variants=alts, clusters=clusters,
                         unpooled=noisy_ref)
    res.verdict = v
    if ev.precision:
        lay = ev.sut if ev.layout_ref is None else _rows(ev.layout_ref, ev.unit.output)
        if lay is None or tuple(lay.shape) != tuple(ev.sut.shape):
            res.precision_note = "the spec's outputs at this layout have another shape"
        else:
            out = torch.zeros(ev.sut.shape[0], dtype=torch.bool)
            out[v.failing_rows] = True
            res.precision = numerics.precision_sample(ev.sut, ev.truth, [ev.ref, *alts, lay], dt,
                                                      leave_out=ev.excused | noisy_ref | out, clusters=clusters)
    reasons = list(v.reasons)
    if not v.ok and ev.routing.check is not None and not ev.routing.check.ok:
        # rows routed away from a tie are judged like any other (never excused): name the likely cause
        reasons.append("likely cause: the target routed rows to other experts than one device, away from any "
                       "near-tie (see [routing])")
    return Check("parity", v.ok, "; ".join(reasons))


def check_greedy(ev: Evidence) -> Check | None:
    """A whole model: the greedy token, and where a failing model first diverges."""
    if not ev.unit.whole_model:
        return None
    if not ev.res.verdict.ok:
        ev.res.first_divergent_layer = first_divergent_layer(ev.results, ev.uref, ev.res.batch, ev.layout, ev.dt,
                                                             ev.excused)
    return greedy_check(ev.sut, ev.truth, ev.ref, ev.excused, ev.dt, ev.labels)


def check_dispatch(ev: Evidence) -> Check | None:
    if not (ev.unit.dispatch and ev.uref.router):
        return None
    return dispatch_check(ev.results, ev.uref, ev.layout, ev.config, ev.res.batch, ev.dt, ev.routing.excused,
                          ev.top_k)


def check_padding_rule(ev: Evidence) -> Check | None:
    modes = {r.value.get("padding_mode") for r in ev.results}
    if ev.layout.dp == 1 or modes == {None}:
        return None
    batch = ev.res.batch
    want = padding_mode(batch, ev.padding_ties)
    ok = modes == {want}
    return Check("padding-rule", ok, "" if ok else
                 f"ranks chose padding mode(s) {sorted(map(str, modes))}; the engine rule gives "
                 f"{want} for modes {batch.forward_modes()} and counts {batch.tokens_per_dp()}")


# The judge's checks, in the order a report lists them: each reads the evidence (and what the checks before
# it left there) and returns its Check, or None where it does not apply. A failed check in GATES ends the
# judging: the checks after it read the rows it vouched for. Adding a check is one function here.
CHECKS = (check_collectives, check_ownership, check_routing, check_router_weights, check_parity, check_greedy,
          check_dispatch, check_padding_rule)
GATES = (check_ownership,)


def judge(res: ParityResult, results: list[RankResult], config: dict, model_dir, layer: int,
          device: str = "cpu", truth_device: str | None = None, precision: bool = False,
          layout_ref: list[RankResult] | None = None, padding_ties: str = MAX_LEN):
    """Every check of CHECKS on one example. `precision`: also gather the precision test's evidence,
    against the reference, its variants and `layout_ref` (the spec's results at this layout; None when the
    target is the spec itself)."""
    uref, variants = oracle_outputs(str(model_dir), res.dtype, device, truth_device, res.unit, layer, res.batch)
    ev = Evidence(res, results, config, layer, uref, variants, precision, layout_ref, padding_ties)
    for check in CHECKS:
        c = check(ev)
        if c is not None:
            res.checks.append(c)
        if check in GATES and c is not None and not c.ok:
            return


@functools.lru_cache(maxsize=32)
def oracle_outputs(model_dir: str, dtype: str, device: str, truth_device: str | None, unit: str, layer: int,
                   batch: Batch) -> tuple[UnitRef, list[torch.Tensor]]:
    """The oracle's answer for one example: (truth and reference, the reference variants). It depends only on
    the model, dtype, devices, unit, layer and batch (inputs are rebuilt from the batch's seed), never on the
    layout, so the layouts of a sweep share it. Callers must not modify what it returns."""
    config, _ = load_weights(model_dir)
    u = units.get(unit)
    oracle = Oracle(model_dir, dtype, device, truth_device)
    inputs = u.global_inputs(batch, config, DTYPES[dtype])
    # one synchronization for both; on CUDA the truth and the reference queued by a worker thread beside the decoys
    return oracle.answer(lambda: u.reference(oracle, layer, batch, inputs), lambda: u.decoys(oracle, layer, batch, inputs))


def overlaps_oracle(world) -> bool:
    """Whether the oracle computes while the ranks compute: for CPU ranks, and for GPU ranks under NVIDIA MPS
    (`gpus.mps_daemon`). On 2 cores it raised the MoE block's examples/s at 1 rank from 27.6 to 41.1; on one
    H200 without MPS, where the oracle's and the ranks' processes share the GPU and their kernels take turns on
    it rather than run together, it cut them from 62.7 to 32.7; on one H100 under MPS it raised them from 67.4
    to 81.8 at 1 rank and 45.9 to 69.7 at 4 (docs/gpu.md)."""
    return world.rank_device == "cpu" or gpus.mps_daemon() is not None


def prefetch_oracle(model_dir: str, dtype: str, device: str, truth_device: str | None, unit: str, layer: int,
                    batch: Batch):
    """World.run's `meanwhile` for one example: the oracle's answer (oracle_outputs, cached) computed while the
    ranks compute, so that an example costs about the longer of the two instead of their sum (docs/gpu.md).
    An error is left for the judge, which asks again once the ranks' results are in and raises it there, in
    the order a serial run would."""
    def prefetch():
        try:
            oracle_outputs(model_dir, dtype, device, truth_device, unit, layer, batch)
        except Exception:       # noqa: BLE001 -- raised again, in its place, by the judge's own call
            pass
    return prefetch


def _rows(results: list[RankResult], key: str) -> torch.Tensor | None:
    outs = [r.value.get(key) for r in results]
    return torch.cat(outs) if all(isinstance(o, torch.Tensor) for o in outs) else None


def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def dispatch_check(results, uref, layout, config, batch, dt, excused, top_k) -> Check:
    """Rows dispatched per expert equal the oracle's routing, up to the near-tie rows (B11: padded rows)."""
    truth_reqs = uref.router[0][0]
    probs = torch.cat(truth_reqs) if truth_reqs else torch.zeros(0, families.num_experts(config))
    # take the extend rows of each request
    rows, flat = [], batch.requests_flat()
    for (_, _, req), p in zip(flat, truth_reqs):
        rows.append(p[-req.extend:] if req.extend else p[:0])
    probs = torch.cat(rows) if rows else probs[:0]
    want = torch.bincount(probs.topk(top_k, dim=1).indices.flatten(), minlength=families.num_experts(config))
    got = torch.zeros_like(want)
    for r in results:
        if layout.moe_tp_rank(r.rank) != 0:
            continue     # every MoE-TP rank of an EP rank dispatches the same rows
        counts = r.value.get("expert_counts") or {}
        if not counts:
            continue
        # one index_add per rank (adding expert by expert cost a third of the judge's Python)
        ids = torch.tensor([int(e) for e in counts], dtype=torch.long)
        if not bool(((ids >= 0) & (ids < len(got))).all()):
            return Check("dispatch", False, f"rank {r.rank} reports rows dispatched to experts "
                         f"{sorted(set(ids.tolist()) - set(range(len(got))))}, outside 0..{len(got) - 1}")
        got.index_add_(0, ids, torch.tensor([int(c) for c in counts.values()], dtype=got.dtype))
    if not any((r.value.get("expert_counts") or {}) for r in results):
        return Check("dispatch", True, "target reports no expert counts")
    slack = int(excused.sum()) * top_k
    diff = (got - want).abs()
    ok = int(diff.sum()) <= 2 * slack
    return Check("dispatch", ok, "" if ok else
                 f"rows dispatched per expert {got.tolist()} != routing of real tokens {want.tolist()} "
                 f"(near-tie slack {slack}): {int(got.sum()) - int(want.sum()):+d} rows; padded rows dispatched?")


def greedy_check(sut, truth, ref, excused, dt, labels) -> Check:
    """Greedy next tokens equal the truth's, except where the truth's top-2 logit margin is within the
    noise one device makes in this dtype (2x the reference's error on that row, plus 2 ulp)."""
    if truth.shape[0] == 0:
        return Check("greedy", True)
    t = truth.to(torch.float64)
    top2 = t.topk(2, dim=1).values
    margin = top2[:, 0] - top2[:, 1]
    noise = numerics.FACTOR * (ref.to(torch.float64) - t).abs().amax(1) + 2 * numerics.ulp(top2[:, 0], dt)
    decided = (margin > noise) & ~excused
    bad = (sut.to(torch.float64).argmax(1) != t.argmax(1)) & decided
    rows = bad.nonzero().flatten().tolist()
    return Check("greedy", not rows, "" if not rows else
                 f"greedy token differs from one device on {len(rows)} decided rows, first {labels[rows[0]]}")


def collective_discipline(results: list[RankResult], layout: Layout) -> Check:
    """Every member of a group issued the same collectives on it, in the same order, with the same shapes."""
    problems = mismatches({r.rank: r.records for r in results})
    return Check("collectives", not problems, "; ".join(problems[:4]))


def first_divergent_layer(results, uref: UnitRef, batch, layout, dt, excused) -> int | None:
    """The first layer whose output (residual stream) leaves the tolerance, when every rank reported its
    per-layer outputs (the optional "layers" of the target protocol); None otherwise."""
    ranks = list(range(layout.tp))
    if not all(len(r.value.get("layers") or ()) == len(uref.layers_truth) for r in results):
        return None
    for i, (lt, lr) in enumerate(zip(uref.layers_truth, uref.layers_ref)):
        sut = torch.cat([r.value["layers"][i] for r in results])
        v = numerics.compare(f"layer {i}", sut, oracle_rows(lt, batch, layout, ranks),
                             oracle_rows(lr, batch, layout, ranks), dt, fan_in=layout.tp, excused=excused)
        if not v.ok:
            return i
    return None
