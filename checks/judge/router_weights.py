"""The router-weights check: the weights a target's router gave its chosen experts, judged in the units of the
dtype they are handed on in.

Which reference. The router is a function of its logits: softmax (or the family's rule), the chosen experts'
values, renormalised where the model says so. The logits are the gate GEMM's output, already judged by parity
(the block's output carries them); their rounding in bfloat16 (about |logit| x 2^-9) moves a weight by several
of its own ulps at production logit sizes, more than any precision habit of the router itself. So the weights
are judged against the family's router function evaluated in float64 on the target's *own* logits and at its
own chosen experts (fixtures.families: `routing_weights`): what the float64 truth would give for those logits,
rounded once. Near-ties cannot matter: the weights of whichever experts the target chose are judged.

The bound (the tolerance model, DESIGN.md: an error is allowed what the legitimate computation's roundings
allow, nothing tuned). A correct router computes in float32 and rounds once to the dtype its weights leave in:
    |w - w64| <= 0.5 ulp_dtype(max(|w|, |w64|))          the one final rounding (none when that is float32)
               + 2 (E + k + 4) u32 |w64|                   float32's own error: E exps (<= 2 u32 each, CPU and
                                                           CUDA), their sum (E - 1), the division, k terms of
                                                           the renormalising sum and its division
An activation-dtype softmax or renormalisation rounds more than once (probabilities, their sum, the quotient):
up to 1.5-2 ulps, so rows pass the bound by a margin no legitimate router reaches (catalog P02 / P05).
"""
from __future__ import annotations

from typing import Any

import torch

from dpep_parity.checks.core import numerics
from dpep_parity.fixtures import families

U32 = 2.0 ** -24


def bound(weights64: torch.Tensor, reported: torch.Tensor, experts: int) -> torch.Tensor:
    """The largest |reported - weights64| a correct float32 router rounded once to reported.dtype can show."""
    k = weights64.shape[-1]
    final = 0.0 if reported.dtype in (torch.float32, torch.float64) else \
        0.5 * numerics.ulp(torch.maximum(weights64.abs(), reported.to(torch.float64).abs()), reported.dtype)
    return final + 2 * (experts + k + 4) * U32 * weights64.abs()


def check(results, config: Any, layers: list[int]) -> tuple[bool, str] | None:
    """(ok, message) over every rank's reported weights of `layers`, or None where there is nothing to judge:
    a target that reports no weights and logits, or a family that declares no router function."""
    rule = families.get(config).routing_weights
    if rule is None or not layers or not all(
            isinstance(r.value.get("routing_weights"), dict) and isinstance(r.value.get("router_logits"), dict)
            and isinstance(r.value.get("routing"), dict) for r in results):
        return None
    bad: list[str] = []
    worst = 0.0
    for r in results:
        for li in layers:
            ids, w, logits = (_layer(r.value[k], li) for k in ("routing", "routing_weights", "router_logits"))
            if ids is None or w is None or logits is None:
                bad.append(f"rank {r.rank}: layer {li}: routing, routing_weights or router_logits missing")
                continue
            if w.shape != ids.shape or logits.shape[0] != ids.shape[0]:
                bad.append(f"rank {r.rank}: layer {li}: weights {tuple(w.shape)}, ids {tuple(ids.shape)}, "
                           f"logits {tuple(logits.shape)} do not match")
                continue
            if not ids.shape[0]:
                continue
            want = rule(config, logits.to(torch.float64), ids.long())
            err = (w.to(torch.float64) - want).abs()
            lim = bound(want, w, logits.shape[1])
            over = ~(err <= lim)                     # NaN fails too
            ratio = (err / lim.clamp_min(1e-300)).nan_to_num(float("inf"))
            worst = max(worst, float(ratio.max()))
            if over.any():
                row, slot = (int(t) for t in over.nonzero()[0])
                held = _held_precision(w)
                ulps = float(err[row, slot] / numerics.ulp(want[row, slot: slot + 1], held)[0]) \
                    if held not in (torch.float32, torch.float64) else float("nan")
                bad.append(f"rank {r.rank}: layer {li}: {int(over.sum())} of {over.numel()} weights beyond one "
                           f"rounding of the router's float64 value on its own logits; row {row} expert "
                           f"{int(ids[row, slot])}: weight {float(w[row, slot]):.6g} ({w.dtype}), float64 "
                           f"{float(want[row, slot]):.8g}, off {float(err[row, slot]):.3g}"
                           + (f" = {ulps:.2f} ulp" if ulps == ulps else "")
                           + (f" of {held} (a {w.dtype} tensor holding only {held} values)"
                              if held != w.dtype else "")
                           + f" > bound {float(lim[row, slot]):.3g}: " + _cause(ulps))
    if bad:
        return False, "; ".join(bad[:3])
    return True, f"worst weight error {worst:.2f} of its bound"


def _layer(d: dict, layer: int):
    """A per-layer output keyed by int or, after a JSON round trip, by str."""
    return d.get(layer, d.get(str(layer)))


def _held_precision(w: torch.Tensor) -> torch.dtype:
    """The narrowest dtype whose values `w` holds exactly: a float32 tensor of bfloat16 values was rounded in
    bfloat16 and cast back (its excess is then read in bfloat16's ulps). Exact zeros and ones say nothing, so
    only the rows' other weights count; a tensor without such weights keeps its own dtype."""
    if w.dtype not in (torch.float32, torch.float64):
        return w.dtype
    informative = w[(w != 0) & (w != 1)]
    if not informative.numel():
        return w.dtype
    for narrow in (torch.bfloat16, torch.float16):
        if bool((informative.to(narrow).to(w.dtype) == informative).all()):
            return narrow
    return w.dtype


def _cause(ulps: float) -> str:
    """What an excess of this size in the dtype's ulps says (NaN: float32 weights, no final rounding)."""
    if ulps == ulps and ulps <= 3:
        return "rounded more than once (a softmax or renormalisation in a narrower dtype?)"
    return "not the family's router function of these logits (another formula, a missing or extra " \
           "renormalisation, or weights of other logits than those reported)"
