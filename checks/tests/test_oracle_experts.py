"""The oracle's float64 experts (checks.oracle_experts: `dpep_padded_bmm`, registered with transformers) against
transformers' own eager experts loop on the same module: same rows up to float64 rounding, for every fixture,
on empty, one-token and many-token inputs, with uneven and empty expert groups; and the choice of the reference's
experts implementation."""
from __future__ import annotations

import pytest
import torch

from dpep_parity.checks import oracle_experts
from dpep_parity.checks.reference import load_model
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.specs import FIXTURES, sparse_layers

U = 2.0 ** -53


def experts_module(name: str):
    m = load_model(str(fixture_path(name)), "float64", "cpu", "eager")
    layer = next(i for i, s in enumerate(sparse_layers(m.config)) if s)
    return m.model.layers[layer].mlp.experts, m.config


def routing(n: int, experts: int, k: int, seed: int, skew: bool):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, experts, generator=g, dtype=torch.float64)
    if skew:   # most rows on experts 0..k-1: one large group, several empty ones
        logits[:, :k] += 4.0
    w, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return w, ids


@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("n,skew", [(0, False), (1, False), (7, False), (64, True)])
@torch.no_grad()
def test_padded_bmm_equals_the_eager_loop(name, n, skew):
    experts, config = experts_module(name)
    k, E = config.num_experts_per_tok, config.num_experts
    w, ids = routing(n, E, k, seed=n + 3, skew=skew)
    x = torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    want = type(experts).forward.__wrapped__(experts, x, ids, w)          # transformers' eager loop
    got = oracle_experts.padded_bmm_experts_forward(experts, x, ids, w)
    assert got.shape == want.shape == (n, config.hidden_size) and got.dtype == torch.float64
    if n:
        # gamma_n per dot product (fan-in: hidden, then the intermediate), k products summed per row
        bound = (config.hidden_size + config.moe_intermediate_size + k) * U
        assert float((got - want).abs().max() / want.abs().max()) <= bound


@torch.no_grad()
def test_out_of_range_expert_ids_add_nothing():
    """transformers' EP sentinels (ids past the experts) are dropped, as its grouped_mm drops them."""
    experts, config = experts_module("qwen3-moe")
    k, E = config.num_experts_per_tok, config.num_experts
    w, ids = routing(5, E, k, seed=1, skew=False)
    x = torch.randn(5, config.hidden_size, dtype=torch.float64)
    masked = ids.clone()
    masked[:, -1] = E                                         # every row's last slot goes to another EP rank
    got = oracle_experts.padded_bmm_experts_forward(experts, x, masked, w)
    keep = oracle_experts.padded_bmm_experts_forward(experts, x, ids[:, :-1], w[:, :-1])
    assert torch.equal(got, keep)


def test_the_truth_loads_through_transformers_switch_and_the_reference_picks_by_device(monkeypatch):
    m = load_model(str(fixture_path("qwen3-moe")), "float64", "cpu", oracle_experts.PADDED)
    assert m.config._experts_implementation == oracle_experts.PADDED
    assert oracle_experts.truth_experts() == oracle_experts.PADDED
    assert oracle_experts.reference_experts(torch.bfloat16, "cpu") == "eager"       # the CPU tier: as calibrated
    grouped = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    assert oracle_experts.reference_experts(torch.bfloat16, "cuda") == ("grouped_mm" if grouped else "eager")
    assert oracle_experts.reference_experts(torch.float64, "cuda") == "eager"
    monkeypatch.setenv("DPEP_ORACLE_EXPERTS", "eager")
    assert oracle_experts.reference_experts(torch.bfloat16, "cuda") == "eager"
    monkeypatch.setenv("DPEP_TRUTH_EXPERTS", "grouped-mm")
    with pytest.raises(ValueError, match="DPEP_TRUTH_EXPERTS='grouped-mm': one of auto, eager, grouped_mm"):
        oracle_experts.truth_experts()
