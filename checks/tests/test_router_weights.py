"""The router-weights check (checks/judge/router_weights.py): a float32 router rounded once to the dtype passes, in
whatever order it sums; a router that rounds its softmax or its renormalisation in bfloat16 fails. End to end:
catalog P02 / P05 fail [router] at their pinned trigger while the spec and every legitimate variant pass it."""
from __future__ import annotations

import pytest
import torch

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.world import RankResult
from dpep_parity.checks.judge import router_weights
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.fixtures.build import fixture_path

QWEN3 = {"model_type": "qwen3_moe", "norm_topk_prob": True}
K = 4


def router_logits(rows=512, experts=16, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, experts, generator=g, dtype=torch.float64) * 2).to(dtype)


def routed(logits, how="float32", out=torch.bfloat16):
    """(sorted ids, their weights) of a top-K router computed `how`."""
    if how == "softmax-bf16":          # catalog P02: probabilities rounded, renormalised in bfloat16
        p = torch.softmax(logits.to(torch.bfloat16), -1)
    elif how == "manual-float32":      # legitimate: exp and sums written out, summed in reverse order
        z = logits.float() - logits.float().max(-1, keepdim=True).values
        e = torch.exp(z)
        p = e / e.flip(-1).cumsum(-1)[:, -1:]
    else:
        p = torch.softmax(logits, -1, dtype=torch.float32)
    w, ids = p.topk(K, -1)
    if how == "renorm-bf16":           # catalog P05: float32 probabilities rounded, then renormalised in bf16
        w = w.to(torch.bfloat16)
    if how == "manual-float32":
        w = w / w.flip(-1).sum(-1, keepdim=True)
    else:
        w = w / w.sum(-1, keepdim=True)
    ids, order = ids.sort(-1)
    return ids, w.to(out).gather(1, order)


def rank(ids, w, logits, r=0):
    return RankResult(r, {"routing": {1: ids}, "routing_weights": {1: w}, "router_logits": {1: logits}}, [], 0.0)


@pytest.mark.parametrize("how", ["float32", "manual-float32"])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
def test_a_float32_router_rounded_once_passes(how, out):
    lg = router_logits(dtype=torch.float32 if out == torch.float32 else torch.bfloat16)
    ok, msg = router_weights.check([rank(*routed(lg, how, out), lg)], QWEN3, [1])
    assert ok, msg


@pytest.mark.parametrize("how", ["softmax-bf16", "renorm-bf16"])
def test_a_router_rounding_in_bfloat16_fails(how):
    lg = router_logits()
    ok, msg = router_weights.check([rank(*routed(lg, how), lg)], QWEN3, [1])
    assert not ok and "rounded more than once" in msg and "ulp" in msg, msg


@pytest.mark.parametrize("how", ["softmax-bf16", "renorm-bf16"])
def test_bfloat16_weights_handed_on_in_a_float32_tensor_are_read_in_bfloat16_ulps(how):
    """SGLang keeps its top-k weights in float32: a renormalisation in bfloat16 cast back (S06) leaves a float32
    tensor of bfloat16 values, which fails and is diagnosed as a narrower dtype's rounding, not another formula."""
    lg = router_logits()
    ids, w = routed(lg, how, torch.bfloat16)
    ok, msg = router_weights.check([rank(ids, w.float(), lg)], QWEN3, [1])
    assert not ok and "rounded more than once" in msg and "holding only torch.bfloat16 values" in msg, msg
    ok, msg = router_weights.check([rank(*routed(lg, "float32", torch.float32), lg)], QWEN3, [1])
    assert ok, msg


def test_without_renormalisation_an_early_rounding_is_the_correct_one():
    """Qwen2-MoE (norm_topk_prob False): a bfloat16 softmax rounds each probability once, as the float32 router's
    final cast does: nothing to catch, and nothing caught."""
    cfg = {"model_type": "qwen2_moe", "norm_topk_prob": False}
    lg = router_logits()
    p = torch.softmax(lg, -1)                     # bfloat16 softmax (float32 inside, one rounding)
    w, ids = p.topk(K, -1)
    ids, order = ids.sort(-1)
    assert router_weights.check([rank(ids, w.gather(1, order), lg)], cfg, [1])[0]


def test_malformed_or_non_finite_weights_fail_and_unjudgeable_reports_are_not_judged():
    lg = router_logits(rows=8)
    ids, w = routed(lg)
    w_nan = w.clone()
    w_nan[3, 1] = float("nan")
    assert not router_weights.check([rank(ids, w_nan, lg)], QWEN3, [1])[0]
    ok, msg = router_weights.check([rank(ids, w[:, :2], lg)], QWEN3, [1])
    assert not ok and "do not match" in msg
    ok, msg = router_weights.check([rank(ids, w, lg), RankResult(1, {"routing": {}, "routing_weights": {},
                                                                      "router_logits": {}}, [], 0.0)], QWEN3, [1])
    assert not ok and "rank 1: layer 1: routing, routing_weights or router_logits missing" in msg
    # nothing to judge: no weights reported, no sparse layer run, a family that declares no router function
    assert router_weights.check([RankResult(0, {"routing": {1: ids}}, [], 0.0)], QWEN3, [1]) is None
    assert router_weights.check([rank(ids, w, lg)], QWEN3, []) is None
    assert router_weights.check([rank(ids, w, lg)], {"model_type": "glm4_moe"}, [1]) is None


PIN = ("qwen3-moe", Layout(2, 2, 2), Batch(((R(4, 1), R(2, 1), R(5, 1)), (R(3, 1),)), 5), "bfloat16", 1)


@pytest.mark.parametrize("target", ["spec", "checks.catalog.variants:EXPERTS_REVERSED", "checks.catalog.variants:EXPERTS_FP32_ACCUMULATE",
                                    "checks.catalog.variants:ALL_REDUCE_BY_GATHER",
                                    "checks.catalog.variants:REDUCE_SCATTER_BY_ALL_REDUCE", "checks.catalog.variants:BATCH_INVARIANT",
                                    "checks.catalog.mutants:P02", "checks.catalog.mutants:P05"])
@pytest.mark.parametrize("unit", ["moe", "model"])
def test_the_catalog_router_habits_fail_router_and_the_legitimate_variants_pass(target, unit):
    fixture, layout, batch, dtype, layer = PIN
    res = run_example(target, unit, str(fixture_path(fixture)), layout, batch, dtype, layer if unit == "moe" else 0)
    router = [c for c in res.checks if c.prop == "router"]
    assert len(router) == 1, res.report()
    if target.endswith(("P02", "P05")):
        assert not router[0].ok and "rounded more than once" in router[0].message, res.report()
        assert res.ok is False
    else:
        assert router[0].ok and res.ok, res.report()
