"""The target protocol: what a system under test implements to be checked by the suite.

A target is any object (named on the command line as `package.module:object`) with:

    name: str
    units: tuple[str, ...]                       # subset of UNITS
    def skip_reason(self, unit, config, layout) -> str | None      # optional; None = supported
    def build(self, unit: str, env: BuildEnv) -> Any               # on every rank, once per layout
    def run(self, built: Any, step: Step) -> dict[str, torch.Tensor]

`build` gets the fixture's config and full weights (canonical Hugging Face names), the rank's place in the
layout and its process groups; `run` gets the rank's local inputs plus the batch metadata engines share.
Outputs (rows = this rank's extend tokens, in request order):
    "out":    [rows, hidden]   for units moe, attention, decoder
    "logits": [rows, vocab]    for unit model
optional: "layers" (list of [rows, hidden] residual stream after each layer, model only: localizes the
first divergent layer), "expert_counts" ({expert: rows dispatched}, this rank's experts),
"padding_mode" ("sum_len" | "max_len"), "routing" ({layer: [rows, top_k] expert ids, sorted} for the
sparse layers the unit ran: with it a near-tie row is excused only where the target's routing really
differs from one device's, and a different choice away from a tie fails), "routing_weights" ({layer: [rows,
top_k]} in the order of the sorted ids) with "router_logits" ({layer: [rows, experts]}): the router-weights check
(checks.judge.router_weights; `Route` builds all three). See docs/targets.md.

Optional: `sessions = True`: the target keeps KV caches across the steps of a serving session. The serving
engine (checks.serving.engine) reads it: such a target gets `Step.serving` (see `Serving`); any other gets
`serving=None` and every request's tokens from its start each step, and recomputes the prefixes.

Debug mode: under `Step.poison` / `BuildEnv.poison` (the stateful property) the suite makes torch.empty and
its kin return NaN-filled float tensors in the rank processes (checks.harness.poison): a target that reads memory it
never wrote fails. A target that allocates outside torch's Python entry points should fill fresh buffers
with NaN itself when the flag is set.

Optional: `harness_modules: tuple[str, ...]`: module prefixes of the target's own glue around a system it
drives (an adapter, not the system under test). An ImportError / AttributeError / NameError / TypeError whose
innermost frame outside torch lies in one of them, or any `HarnessFault` the target raises, means the glue does
not fit the system (a renamed function, a moved module): the example ends as a harness error (`HarnessFault`
from `run_example`: replay exits 3, `dpep bisect` counts ERROR), never as a verdict on the system. Everything
else a rank raises is the system's crash (the no-crash property).

Optional: `padding_ties: str` ("max_len", the default, or "sum_len"): the DP padding mode the target chooses
when both modes move the same number of rows (an engine's policy; the padding-rule property holds it to it).

Optional: `unsupported_families: dict[str, str]` (model_type -> why): model families (fixtures.families) the
target does not implement. The suite leaves those fixtures out of its draws for the target (the pytest header
names them with the reason) and skips an example of one with that reason.

Optional: `invariances: frozenset[str]` (of "batch", "placement", "layout") and `invariant_layouts` (groups of
layout names, or a function of the model's config returning them): what the target promises bitwise, whatever is
co-batched with a request, wherever it is placed, and across the layouts of each group. The invariance properties
(property_tests/test_invariance.py, checks/judge/invariance.py) fail a broken promise and measure the drift of a target
that promises nothing.

Optional: `known_failure(result, fixture, layer) -> str | None`: a diagnosed bug of the target (written up
in docs/findings.md) that explains every failed check of this result; the suite reports it as an
expected failure with that text instead of a new failure.
"""
from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from dpep_parity import own_module
from dpep_parity.checks.core.batches import MAX_LEN, Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.units import UNITS  # noqa: F401  (re-exported: the registry is checks/units/)
from dpep_parity.registry import Registry


def _implements_protocol(obj: Any) -> None:
    missing = [need for need in ("name", "units", "build", "run") if not hasattr(obj, need)]
    if missing:
        raise ValueError(f"a target needs {', '.join(missing)}: see docs/targets.md")


# the named targets (`--target spec`): the shipped two, imported on first use, and outside packages' (entry
# points of group dpep_parity.targets, each a target object or class); any 'package.module:object' works too
TARGETS: Registry[Any] = Registry("targets", check=_implements_protocol)
TARGETS.refer("spec", "dpep_parity.checks.targets.spec:SPEC")
TARGETS.refer("sglang", "dpep_parity.checks.targets.sglang:TARGET")


@dataclass
class Groups:
    """This rank's process groups (torch.distributed handles) and their ranks."""
    tp: Any
    attn_tp: Any
    moe_tp: Any
    moe_ep: Any
    ranks: dict[str, tuple[int, ...]]


@dataclass
class BuildEnv:
    config: dict
    weights: dict[str, torch.Tensor]   # full, canonical names, float32 on CPU
    layout: Layout
    rank: int
    groups: Groups
    dtype: torch.dtype
    device: torch.device
    layer: int                          # the layer a single-layer unit is taken from
    poison: bool = False                # debug mode: fresh memory must read as garbage (see Step.poison)


@dataclass(frozen=True)
class Serving:
    """This DP rank's part of one step of a serving session (checks.serving, unit model only).

    Requests live across the steps of a session: each step extends some of them (a prefill chunk, or one
    decode token). A target that declares `sessions = True` keeps each request's KV cache under its id from
    the step that computed it and reads its prefix from there; a target without it recomputes the prefix
    from `Step.inputs`, which always carry the whole sequence (prefix + extend tokens)."""
    session: str                        # a new id means every earlier session's state can go
    ids: tuple[int, ...]                # this DP rank's request ids, in the order of Step.requests
    released: tuple[int, ...] = ()      # ids of this DP rank that finished: their cache can be freed
    capacity: tuple[int, int, int] = (0, 0, 0)   # at most (tokens, requests, tokens of one request) held at
                                        # once on this DP rank during the session: size caches once


@dataclass
class Step:
    """One forward on one rank."""
    batch: Batch                        # global metadata: requests of every DP rank (shared by engines)
    rank: int
    dp_rank: int
    requests: tuple[Request, ...]       # this DP rank's requests
    inputs: list[torch.Tensor]          # per local request: hidden [prefix+extend, hidden] or token ids
                                        # (unit moe: one tensor [extend rows, hidden])
    unit: str = "model"
    serving: Serving | None = None      # set by the serving engine: see Serving
    poison: bool = False                # debug mode (the stateful property): torch.empty & co. return NaN-filled
                                        # float tensors (checks.harness.poison); a target allocating elsewhere (C++,
                                        # its own pools) should fill fresh buffers with NaN itself when set

    @property
    def num_tokens(self) -> int:
        return sum(r.extend for r in self.requests)


@dataclass(frozen=True)
class Route:
    """What a router did for some rows: expert ids [rows, k], their weights [rows, k] as the experts receive them,
    and the logits [rows, experts] the router read. `rows` keeps a slice with every row's ids sorted and its
    weights in the same order; `report` turns {layer: Route} into the outputs "routing", "routing_weights" and
    "router_logits" (weights and logits only where every layer has them)."""
    ids: torch.Tensor
    weights: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def rows(self, start: int, n: int) -> Route:
        ids, order = self.ids[start: start + n].sort(dim=-1)
        w = None if self.weights is None else self.weights[start: start + n].gather(1, order.to(self.weights.device))
        lg = None if self.logits is None else self.logits[start: start + n]
        return Route(ids.clone(), None if w is None else w.clone(), None if lg is None else lg.clone())

    @staticmethod
    def cat(routes: list[Route]) -> Route:
        parts = {f: [getattr(r, f) for r in routes] for f in ("ids", "weights", "logits")}
        return Route(*(None if any(t is None for t in ts) else torch.cat(ts) for ts in parts.values()))

    @staticmethod
    def report(routes: dict[int, Route]) -> dict:
        out: dict = {"routing": {i: r.ids for i, r in routes.items()}}
        if routes and all(r.weights is not None and r.logits is not None for r in routes.values()):
            out["routing_weights"] = {i: r.weights for i, r in routes.items()}
            out["router_logits"] = {i: r.logits for i, r in routes.items()}
        return out


def to_cpu(v):
    """A unit's result with every tensor (in lists and dicts too) detached and on the CPU: what `run` returns
    travels back to the suite's process."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu()
    if isinstance(v, list):
        return [to_cpu(x) for x in v]
    if isinstance(v, dict):
        return {k: to_cpu(x) for k, x in v.items()}
    return v


class HarnessFault(RuntimeError):
    """The target's glue could not run the example (see `harness_modules`): no verdict on the system."""


_GLUE_ERRORS = (ImportError, AttributeError, NameError, TypeError)


def harness_fault(target: Any, exc: BaseException) -> bool:
    """Whether `exc`, raised by the target's build or run, is its glue's fault (module doc, harness_modules)."""
    if isinstance(exc, HarnessFault):
        return True
    names = getattr(target, "harness_modules", ())
    if not names or not isinstance(exc, _GLUE_ERRORS):
        return False
    where = None
    tb = exc.__traceback__
    while tb is not None:                       # the innermost frame outside torch's own package
        f = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if f"{os.sep}torch{os.sep}" not in f:
            where = f
        tb = tb.tb_next
    return where is not None and any(where == p or where.startswith(p + os.sep) for p in _paths(tuple(names)))


@functools.cache
def _paths(names: tuple[str, ...]) -> tuple[str, ...]:
    """The files (a module) or folders (a package) of module names."""
    out = []
    for n in names:
        m = importlib.import_module(own_module(n))
        f = os.path.realpath(m.__file__)
        out.append(os.path.dirname(f) if hasattr(m, "__path__") else f)
    return tuple(out)


def resolve(spec: str | Any) -> Any:
    """'spec', 'pkg.mod:obj' or an object. A class is instantiated with no arguments."""
    if not isinstance(spec, str):
        return spec
    if ":" not in spec:
        if spec not in TARGETS:
            raise ValueError(f"target {spec!r}: expected 'package.module:object' or one of {sorted(TARGETS)}")
        try:
            return TARGETS[spec]
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"cannot load target {spec!r} ({TARGETS.origin(spec)}): {e}") from e
    mod, _, attr = spec.partition(":")
    try:
        obj = getattr(importlib.import_module(own_module(mod)), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load target {spec!r}: {e}") from e
    obj = obj() if isinstance(obj, type) else obj
    for need in ("name", "units", "build", "run"):
        if not hasattr(obj, need):
            raise ValueError(f"target {spec!r} lacks {need!r}: see docs/targets.md")
    return obj


def family_skip(target: Any, config: Any) -> str | None:
    """Why the target does not implement the family of `config` (a config mapping, a FixtureSpec), or None."""
    if config is None:
        return None
    from dpep_parity.fixtures import families
    arch = getattr(config, "arch", None) or families.cfg(config, "model_type") or "qwen2_moe"
    why = (getattr(target, "unsupported_families", None) or {}).get(arch)
    return f"target {target.name} does not implement the {arch} family: {why}" if why else None


def left_out_fixtures(target: str, fixtures) -> tuple[tuple[str, str], ...]:
    """(fixture, why) for the fixtures whose family the target declares it does not implement."""
    from dpep_parity.fixtures.specs import FIXTURES
    tgt = resolve(target)
    return tuple((f, why) for f in fixtures if f in FIXTURES and (why := family_skip(tgt, FIXTURES[f])))


def skip_reason(target: Any, unit: str, config: dict | None, layout: Layout | None) -> str | None:
    family = family_skip(target, config)
    if family:
        return family
    fn = getattr(target, "skip_reason", None)
    if unit not in target.units:
        why = fn(unit, config, layout) if fn else None
        return why or f"target {target.name} does not implement unit {unit!r} (it has {', '.join(target.units)})"
    return fn(unit, config, layout) if fn else None


def padding_ties(target: Any) -> str:
    """The DP padding mode the target chooses when SUM_LEN and MAX_LEN cost the same (batches.padding_mode)."""
    return getattr(target, "padding_ties", MAX_LEN)


def known_failure(target: Any, result: Any, fixture: str, layer: int) -> str | None:
    fn = getattr(target, "known_failure", None)
    return fn(result, fixture, layer) if fn and not result.ok else None
