"""The oracle's float64 experts (checks.oracle.oracle_experts: `dpep_padded_bmm`, registered with transformers) against
transformers' own eager experts loop on the same module: same rows up to float64 rounding, for every fixture,
on empty, one-token and many-token inputs, with uneven and empty expert groups; the choice of the reference's
experts implementation; and the decoy variants' experts (`<inner>+dtype_sum`: a token's expert outputs added in
the dtype, the eager loop's habit), with the false alarm they remove reproduced on the CPU."""
from __future__ import annotations

import pytest
import torch

from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.numerics import PrecisionPool, precision_sample
from dpep_parity.checks.oracle import oracle_experts
from dpep_parity.checks.oracle.reference import Oracle, load_model
from dpep_parity.fixtures import families
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import sparse_layers
from dpep_parity.fixtures.specs import FIXTURES

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
    k, E = config.num_experts_per_tok, families.num_experts(config)
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
    k, E = config.num_experts_per_tok, families.num_experts(config)
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


grouped_on_cpu = pytest.mark.skipif(not oracle_experts.grouped_available(), reason="this torch has no grouped_mm")


@grouped_on_cpu
@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("n,skew", [(0, False), (1, False), (7, False), (64, True)])
@torch.no_grad()
def test_the_dtype_sum_decoy_is_transformers_eager_loop_bit_for_bit_on_the_cpu(name, n, skew):
    """grouped_mm's per-slot GEMMs on the CPU are the eager loop's per-expert GEMMs, so the decoy's only change,
    the accumulation, must give the eager loop's exact bits. Control: grouped_mm itself (float32 sum, one
    rounding) differs from the eager loop wherever a token adds three or more expert outputs."""
    m = load_model(str(fixture_path(name)), "bfloat16", "cpu", "eager")
    experts = m.model.layers[next(i for i, s in enumerate(sparse_layers(m.config)) if s)].mlp.experts
    k, E = m.config.num_experts_per_tok, families.num_experts(m.config)
    w, ids = routing(n, E, k, seed=n + 5, skew=skew)
    w = w.to(torch.bfloat16)
    x = torch.randn(n, m.config.hidden_size, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    eager = type(experts).forward.__wrapped__(experts, x, ids, w)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    decoy = ALL_EXPERTS_FUNCTIONS[oracle_experts.decoy_experts("grouped_mm")](experts, x, ids, w)
    assert decoy.dtype == torch.bfloat16 and torch.equal(decoy, eager)
    if n >= 7 and k >= 3:
        assert not torch.equal(ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, x, ids, w), eager)


def test_decoys_take_the_other_habit_only_where_the_reference_adds_in_float32():
    assert oracle_experts.decoy_experts("grouped_mm") == "grouped_mm+dtype_sum"
    assert oracle_experts.decoy_experts("batched_mm") == "batched_mm+dtype_sum"
    assert oracle_experts.decoy_experts("eager") is None        # the CPU tier's reference has the dtype habit


@grouped_on_cpu
@torch.no_grad()
def test_a_correct_eager_loop_target_is_no_precision_fault_against_a_grouped_reference(monkeypatch):
    """The H200 false alarm, on the CPU: the reference through grouped_mm (float32 sum, as on CUDA) and a target
    with transformers' eager habit (the expert outputs added in bfloat16: 3 roundings where the reference makes
    1 at top-4). Against the reference and its plain company decoy the precision test fails that correct target
    (the alarm); with the oracle's decoy among 7 rows, which takes the eager habit, it passes. The decoy really
    is the eager block there (bitwise), and the reference's own implementation is back afterwards."""
    monkeypatch.setenv("DPEP_ORACLE_EXPERTS", "grouped_mm")
    path = str(fixture_path("qwen3-moe"))
    oracle = Oracle(path, "bfloat16", "cpu")
    eager = load_model(path, "bfloat16", "cpu", "eager").model.layers[1].mlp
    alarm, judged = PrecisionPool(), PrecisionPool()
    for seed in range(8):
        x = torch.randn(64, oracle.config.hidden_size, generator=torch.Generator().manual_seed(seed)).bfloat16()
        ref = oracle.mlp(1, x)
        alone, among7 = oracle.decoy_rows(1, Batch(((Request(0, 64),),), seed), x)
        target = eager(x[None])[0]
        if seed == 0:
            g = torch.Generator().manual_seed(seed + 1)   # decoy_rows' draws: 1 decoy row, then 7
            torch.randn(1, x.shape[1], generator=g, dtype=torch.float64)
            company = torch.randn(7, x.shape[1], generator=g, dtype=torch.float64).to(torch.bfloat16)
            assert torch.equal(among7, eager(torch.cat([x, company])[None])[0, :64])
        alarm.add(f"seed {seed}", precision_sample(target, ref.truth, [ref.ref, alone], torch.bfloat16))
        judged.add(f"seed {seed}", precision_sample(target, ref.truth, [ref.ref, alone, among7], torch.bfloat16))
    assert oracle.ref_model.config._experts_implementation == "grouped_mm"
    bad, good = alarm.verdict(), judged.verdict()
    assert not bad.ok and bad.mean > 0, bad
    assert good.ok and good.mean <= 0, good
