"""Calibration of the tolerance model on a model family's real units: `python -m checks.tools.calibrate --family F`.

The GEMM calibration (checks.tools.calibrate) shows the model's bound holds for one realistic GEMM; a family brings
its own arithmetic around the GEMMs (GLM-4.5: a sigmoid router with a correction bias in float32, a routed
scaling factor of 2.5, an ungated shared expert, partial rotary). Here the family's fixture runs through a target
that implements it (default: the sglang target, the only one that implements every family) at every valid layout
of world sizes 1, 2 and 4, in bfloat16 and float32, for the moe and decoder units, on deterministic batches
with every DP rank busy and one DP rank idle. Three systems are judged:

- the target itself (legitimate: another implementation of the same function, its own layouts' rounding): must
  pass every example, or fail it only by a written-up finding of the target (its `known_failure`: SGLang's F2,
  pad rows dispatched, is a dispatch count, not a tolerance); an example where a known finding leaves no output
  at all (F7: GPT-OSS does not load with EP) calibrates nothing and is counted apart;
- BIASED: the target's outputs moved 1 ulp toward +inf (torch.nextafter), inside the max-error bound: the parity
  check's bias test must catch it (at least one example per dtype and unit);
- DOUBLED: the target's outputs times 2 (a reduction applied twice: SGLang #37187's class): the parity check must
  fail every example.

The model holds when all three behave so. Printed: per dtype and unit, examples run, passes, and the worst
excess over the bound (the target), the bias z (BIASED), the |sut|/|truth| ratio (DOUBLED).
"""
from __future__ import annotations

import random
import time

import torch

from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import valid_layouts
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.targets.protocol import known_failure, resolve
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import fixture_config, sparse_layers
from dpep_parity.fixtures.specs import FIXTURES


class _Planted:
    """A target's outputs changed after it ran: `fault` maps each float output tensor to the planted one."""

    def __init__(self, inner: str, fault, tag: str):
        self.inner_name, self.fault, self.tag = inner, fault, tag

    @property
    def inner(self):
        return resolve(self.inner_name)

    @property
    def name(self) -> str:
        return f"{self.inner.name}+{self.tag}"

    @property
    def units(self):
        return self.inner.units

    def __getattr__(self, key):           # padding_ties, harness_modules, skip_reason, unsupported_families
        if key in ("inner_name", "fault", "tag"):
            raise AttributeError(key)
        return getattr(self.inner, key)

    def build(self, unit, env):
        return self.inner.build(unit, env)

    def run(self, built, step):
        out = self.inner.run(built, step)
        return {k: self.fault(v) if k in ("out", "logits") and isinstance(v, torch.Tensor) else v
                for k, v in out.items()}


def _parity_failed(res) -> bool:
    """The tolerance model's own check failed (not another property: a planted output fault is judged by it)."""
    return any(c.prop == "parity" for c in res.failures())


def _biased(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, float("inf")))


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


BIASED = {t: _Planted(t, _biased, "biased-1ulp") for t in ("sglang", "spec")}
DOUBLED = {t: _Planted(t, _doubled, "doubled") for t in ("sglang", "spec")}


def examples(fixture: str, unit: str, n_per_layout: int = 1, seed: int = 0):
    """Every valid layout of world sizes 1, 2, 4, each with `n_per_layout` batches (every DP rank busy; with
    DP, also one with DP rank 1 idle), on a sparse layer and, where the family has one, a dense layer."""
    rng = random.Random(f"{seed}-{fixture}-{unit}")
    cfg = fixture_config(fixture)
    sparse = sparse_layers(cfg)
    layers = sorted({sparse.index(True), *([sparse.index(False)] if False in sparse else [])})
    k = 0                                      # examples so far: the layers take turns
    for ws in (1, 2, 4):
        for lay in valid_layouts(ws, cfg):
            for _ in range(n_per_layout):
                busy = tuple(tuple(Request(rng.choice([0, rng.randint(2, 24)]), rng.randint(8, 24))
                                   for _ in range(rng.randint(1, 3))) for _ in range(lay.dp))
                batches = [busy] + ([tuple(() if d == 1 else r for d, r in enumerate(busy))] if lay.dp > 1 else [])
                for per in batches:
                    yield lay, Batch(per, rng.randrange(2**16)), layers[k % len(layers)]
                    k += 1


def run(fixture: str, target: str = "sglang", dtypes=("bfloat16", "float32"), units=("moe", "decoder")) -> bool:
    if fixture not in FIXTURES:
        raise SystemExit(f"--family: unknown fixture {fixture!r}; known: {sorted(FIXTURES)}")
    if target not in BIASED:
        raise SystemExit(f"--family calibration knows the planted faults of targets {sorted(BIASED)}")
    t0 = time.perf_counter()
    model = str(fixture_path(fixture))
    holds = True
    print(f"family calibration: {fixture} through {target}, world sizes 1, 2, 4, every valid layout")
    print(f"{'dtype':9} {'unit':8} {'examples':>8} | {'target pass':>11} {'worst excess':>12} | "
          f"{'biased caught':>13} {'max |z|':>7} | {'doubled caught':>14} {'ratio':>6}")
    for dtype in dtypes:
        for unit in units:
            n = passed = explained = biased_caught = doubled_caught = unrunnable = 0
            worst, zmax, ratio = 0.0, 0.0, []
            for lay, batch, layer in examples(fixture, unit):
                args = (unit, model, lay, batch, dtype, layer)
                good = run_example(target, *args, deadline_s=300)
                if good.skipped:
                    continue
                known = known_failure(resolve(target), good, fixture, layer)
                if known and good.verdict is None:     # a known finding gave no output (GPT-OSS with EP: F7)
                    unrunnable += 1
                    print(f"  {dtype} {unit} {lay} [{batch.describe()}] L{layer}: target gives no output ({known}): "
                          "not calibrated", flush=True)
                    continue
                n += 1
                passed += good.ok or bool(known)
                explained += bool(known)
                if good.verdict is not None:
                    worst = max(worst, good.verdict.worst_excess)
                bad = run_example(f"checks.tools.calibrate_family:BIASED_{target.upper()}", *args, deadline_s=300)
                biased_caught += _parity_failed(bad)
                if bad.verdict is not None:
                    zmax = max(zmax, abs(bad.verdict.bias_z))
                dbl = run_example(f"checks.tools.calibrate_family:DOUBLED_{target.upper()}", *args, deadline_s=300)
                doubled_caught += _parity_failed(dbl)
                if dbl.verdict is not None:
                    ratio.append(dbl.verdict.ratio)
                verdict = "pass" if good.ok else (f"xfail ({known})" if known else "FAIL")
                print(f"  {dtype} {unit} {lay} [{batch.describe()}] L{layer}: target {verdict}, biased "
                      f"{'caught' if _parity_failed(bad) else 'passed'}, doubled "
                      f"{'caught' if _parity_failed(dbl) else 'passed'}", flush=True)
            row_ok = n > 0 and passed == n and biased_caught > 0 and doubled_caught == n
            holds &= row_ok
            r = f"{min(ratio):.3f}" if ratio else "-"
            print(f"{dtype:9} {unit:8} {n:>8} | {passed:>5}/{n:<5} {worst:>12.3f} | {biased_caught:>6}/{n:<6} "
                  f"{zmax:>7.1f} | {doubled_caught:>7}/{n:<6} {r:>6}  {'ok' if row_ok else 'MODEL BROKEN'}"
                  f"{f' ({explained} of the passes are known findings of the target)' if explained else ''}"
                  f"{f'; {unrunnable} examples without output (known finding), not calibrated' if unrunnable else ''}",
                  flush=True)
    print(f"{'model holds' if holds else 'MODEL BROKEN'} for {fixture}: the target passes every example, the 1-ulp "
          f"bias is caught, the doubled reduction fails every example ({time.perf_counter() - t0:.0f}s)")
    return holds


BIASED_SGLANG, DOUBLED_SGLANG, BIASED_SPEC, DOUBLED_SPEC = BIASED["sglang"], DOUBLED["sglang"], BIASED["spec"], \
    DOUBLED["spec"]
