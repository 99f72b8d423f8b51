"""Layouts: every validation rule, SGLang's rank maps (written here independently), enumeration, parsing."""
from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpep_parity.checks.core.topology import InvalidLayout, Layout, layout_violations, valid_layouts, validate
from dpep_parity.fixtures.build import hf_config
from dpep_parity.fixtures.specs import FIXTURES

# A config every rule accepts at tp4-dp2-ep2; each case below breaks exactly one number of it.
BASE = {"num_attention_heads": 8, "num_key_value_heads": 2, "num_experts": 8, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "intermediate_size": 128, "vocab_size": 512}

# (rule as the message must name it, layout, config overrides or None for no config)
RULES = [
    ("tp >= 1", Layout(0, 1, 1), None),
    ("dp >= 1", Layout(2, 0, 1), None),
    ("ep >= 1", Layout(2, 1, -1), None),
    ("tp % dp", Layout(4, 3, 1), {}),
    ("tp % ep", Layout(4, 1, 3), {}),
    ("dp_lm_head needs dp > 1", Layout(4, 1, 1, True), {}),
    ("num_attention_heads % attn_tp", Layout(4, 1, 1), {"num_attention_heads": 6}),
    ("num_key_value_heads and attn_tp", Layout(4, 1, 1),
     {"num_attention_heads": 12, "num_key_value_heads": 3}),
    ("num_experts % ep", Layout(4, 1, 4), {"num_experts": 6}),
    ("tp <= num_experts with EP", Layout(4, 1, 2), {"num_experts": 2}),
    ("moe_intermediate_size % moe_tp", Layout(4, 1, 1), {"moe_intermediate_size": 30}),
    ("shared expert width % tp", Layout(4, 2, 2), {"shared_expert_intermediate_size": 66}),
    ("n_shared_experts x moe_intermediate_size", Layout(4, 4, 4),
     {"shared_expert_intermediate_size": 0, "n_shared_experts": 3, "moe_intermediate_size": 2}),
    ("num_experts % ep", Layout(4, 1, 4), {"num_experts": None, "n_routed_experts": 6}),
    ("intermediate_size % tp", Layout(4, 2, 2), {"intermediate_size": 130}),
    ("vocab_size % lm_head group", Layout(4, 2, 2), {"vocab_size": 514}),
]


def test_base_config_is_valid():
    assert layout_violations(Layout(4, 2, 2), BASE) == []
    assert validate(Layout(4, 2, 2), BASE) == Layout(4, 2, 2)


@pytest.mark.parametrize("rule,layout,overrides", RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_enforced_and_named(rule, layout, overrides):
    config = None if overrides is None else {**BASE, **overrides}
    bad = layout_violations(layout, config)
    assert len(bad) == 1, bad            # the case breaks this rule and no other
    assert rule in bad[0]
    with pytest.raises(InvalidLayout, match=re.escape(rule)) as e:
        validate(layout, config)
    assert str(layout) in str(e.value)


WITH_CONFIG = [r for r in RULES if r[2]]


@pytest.mark.parametrize("rule,layout,overrides", WITH_CONFIG, ids=[r[0] for r in WITH_CONFIG])
def test_the_broken_number_is_the_cause(rule, layout, overrides):
    """The same layout on the unmodified config is valid: the overridden number alone broke it."""
    assert layout_violations(layout, BASE) == []


def test_rules_that_depend_on_the_layout_shape():
    cfg = {**BASE, "num_experts": 2}
    assert layout_violations(Layout(4, 1, 1), cfg) == []          # tp > experts is fine without EP
    cfg = {**BASE, "moe_intermediate_size": 30}
    assert layout_violations(Layout(4, 1, 2), cfg) == []          # moe_tp = 2 divides 30
    cfg = {**BASE, "vocab_size": 514}
    assert layout_violations(Layout(4, 2, 1, True), cfg) == []    # dp_lm_head: group is attn_tp = 2
    cfg = {**BASE, "num_key_value_heads": 8, "num_attention_heads": 8}
    assert layout_violations(Layout(4, 1, 1), cfg) == []          # KV heads split over attn_tp
    cfg = {**BASE, "num_key_value_heads": 1}
    assert layout_violations(Layout(4, 1, 1), cfg) == []          # one KV head replicated
    cfg = {k: v for k, v in BASE.items() if k not in ("num_experts", "moe_intermediate_size")}
    assert layout_violations(Layout(4, 1, 3), cfg) != []          # a dense model still needs tp % ep


def test_several_broken_rules_are_all_reported():
    cfg = {**BASE, "intermediate_size": 130, "vocab_size": 514}
    bad = layout_violations(Layout(4, 1, 1), cfg)
    assert len(bad) == 2 and any("intermediate_size" in b for b in bad) and any("vocab" in b for b in bad)


# ---------------- rank maps: SGLang's rules, written independently ----------------
def sglang_attn(tp: int, dp: int):
    """compute_dp_attention_world_info: attn_tp_rank = tp_rank % attn_tp, dp_rank = tp_rank // attn_tp."""
    attn_tp = tp // dp
    groups: dict[int, list[int]] = {}
    for rank in range(tp):
        groups.setdefault(rank // attn_tp, []).append(rank)
    return attn_tp, groups


def sglang_moe(tp: int, ep: int):
    """initialize_model_parallel with one TP group: EP groups range(j, tp, moe_tp) for j < moe_tp; MoE-TP
    groups range(j * moe_tp, (j + 1) * moe_tp) for j < ep."""
    moe_tp = tp // ep
    ep_groups = [list(range(j, tp, moe_tp)) for j in range(moe_tp)]
    tp_groups = [list(range(j * moe_tp, (j + 1) * moe_tp)) for j in range(ep)]
    return ep_groups, tp_groups


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


layouts = st.integers(1, 16).flatmap(
    lambda tp: st.tuples(st.just(tp), st.sampled_from(divisors(tp)), st.sampled_from(divisors(tp))))


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_rank_maps_match_sglang(t):
    tp, dp, ep = t
    lay = Layout(tp, dp, ep)
    attn_tp, attn = sglang_attn(tp, dp)
    assert lay.attn_tp == attn_tp
    assert [list(g) for g in lay.attn_tp_groups()] == [attn[d] for d in range(dp)]
    ep_groups, moe_tp_groups = sglang_moe(tp, ep)
    assert sorted(map(list, lay.moe_ep_groups())) == sorted(ep_groups)
    assert sorted(map(list, lay.moe_tp_groups())) == sorted(moe_tp_groups)
    for rank in range(tp):
        assert lay.dp_rank(rank) == rank // attn_tp
        assert lay.attn_tp_groups()[lay.dp_rank(rank)].index(rank) == lay.attn_tp_rank(rank)
        my_tp = next(g for g in lay.moe_tp_groups() if rank in g)
        my_ep = next(g for g in lay.moe_ep_groups() if rank in g)
        assert set(my_tp) & set(my_ep) == {rank}               # the MoE grid: one rank per (tp, ep) cell
        assert my_tp.index(rank) == lay.moe_tp_rank(rank)
        assert my_ep.index(rank) == lay.moe_ep_rank(rank)
        assert my_tp == tuple(range(my_tp[0], my_tp[0] + len(my_tp)))    # contiguous
    assert lay.tp_group() == tuple(range(tp))
    for kind, groups in lay.all_groups().items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(tp)), kind                    # a partition of the TP group
        assert len({len(g) for g in groups}) == 1, kind         # of equal sizes


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(1, 8))
def test_experts_are_contiguous_blocks_per_ep_rank(t, per_rank):
    tp, dp, ep = t
    lay, experts = Layout(tp, dp, ep), per_rank * ep
    owner = {}
    for rank in range(tp):
        block = list(lay.local_experts(rank, experts))
        assert block == list(range(block[0], block[0] + per_rank))
        for e in block:
            assert e // per_rank == rank // (tp // ep)           # expert e lives on EP rank e // (E / ep)
            owner.setdefault(e, set()).add(rank)
    assert sorted(owner) == list(range(experts))               # every expert is owned
    for ranks in owner.values():                                # by exactly one MoE-TP group
        assert tuple(sorted(ranks)) in lay.moe_tp_groups()


# ---------------- enumeration ----------------
@pytest.mark.parametrize("name", sorted(FIXTURES))
@pytest.mark.parametrize("lm_head", [False, True])
def test_valid_layouts_is_brute_force(name, lm_head):
    cfg = hf_config(FIXTURES[name])
    for ws in range(1, 9):
        brute = []
        for dp, ep, lm in itertools.product(range(1, 2 * ws + 1), range(1, 2 * ws + 1), (False, True)):
            if lm and not lm_head:
                continue
            try:
                brute.append(validate(Layout(ws, dp, ep, lm), cfg))
            except InvalidLayout:
                pass
        got = valid_layouts(ws, cfg, dp_lm_head=lm_head)
        assert sorted(got) == sorted(brute), (name, ws)
        assert len(set(got)) == len(got)
        assert [(x.dp, x.ep) for x in got] == sorted((x.dp, x.ep) for x in got)   # smallest dp/ep first
        assert all(x.world_size == ws for x in got)


def test_valid_layouts_by_hand():
    # qwen2-moe-shared: 4 heads / 2 KV heads, 8 experts, moe_i 32, shared 64, vocab 512
    cfg = hf_config(FIXTURES["qwen2-moe-shared"])
    got = {(x.dp, x.ep) for x in valid_layouts(8, cfg)}
    assert got == {(dp, ep) for dp in (2, 4, 8) for ep in (1, 2, 4, 8)}    # attn_tp 8 > 4 heads
    # qwen3-moe-dense: 8 heads, 1 KV head (replicated), 8 experts
    cfg = hf_config(FIXTURES["qwen3-moe-dense"])
    assert {(x.dp, x.ep) for x in valid_layouts(4, cfg)} == {(dp, ep) for dp in (1, 2, 4) for ep in (1, 2, 4)}
    assert valid_layouts(3, cfg) == []                          # 3 divides no head count
    assert valid_layouts(1, cfg) == [Layout(1)]


# ---------------- parsing ----------------
@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64), st.booleans())
def test_parse_round_trips(tp, dp, ep, lm):
    lay = Layout(tp, dp, ep, lm)
    assert Layout.parse(str(lay)) == lay
    assert Layout.parse(f"tp={tp},dp={dp},ep={ep}" + (",dplmhead" if lm else "")) == lay


def test_parse_defaults():
    assert Layout.parse("tp4") == Layout(4, 1, 1, False)
    assert Layout.parse("ep2-tp4") == Layout(4, 1, 2)


@pytest.mark.parametrize("text", ["", "tp", "dp2-ep2", "tp4-xp2", "tp-4", "tpfour", "tp4dp2", "TP4",
                                  "tp4-dp", "tp4-dp2-", "tp=4=", "tp4,dp2.5", "tp4 dp2"])
def test_bad_strings_raise(text):
    with pytest.raises(InvalidLayout, match="layout"):
        Layout.parse(text)
