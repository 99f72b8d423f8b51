"""Meta-tests: the strategies reach the edge cases the catalog's bugs need (as hypothesis's own suite
does with find_any). A strategy that cannot produce them would let every property pass vacuously."""
from __future__ import annotations

import pytest
from hypothesis import find, settings

from dpep_parity.checks.core.batches import DECODE, IDLE, MAX_LEN, padding_mode
from dpep_parity.fixtures.specs import FIXTURES
from dpep_parity.property_tests.strategies import batches, examples

SEARCH = settings(max_examples=2000, derandomize=True, database=None)


def reach(strategy, condition):
    return find(strategy, condition, settings=SEARCH)


@pytest.mark.parametrize("dp", [2, 4])
def test_reaches_a_zero_token_rank(dp):
    b = reach(batches(dp), lambda b: 0 in b.tokens_per_dp() and not b.nobody_runs)
    assert IDLE in b.forward_modes()


def test_reaches_every_rank_empty_but_one():
    b = reach(batches(4), lambda b: sum(1 for c in b.tokens_per_dp() if c) == 1)
    assert sorted(b.tokens_per_dp())[:3] == [0, 0, 0]


def test_reaches_all_ranks_idle():
    assert reach(batches(2), lambda b: b.nobody_runs).nobody_runs


def test_reaches_counts_unaligned_to_attention_tp():
    ex = reach(examples(tuple(FIXTURES), (4,), ("float32",), "moe"),
               lambda e: e.layout.attn_tp > 1 and any(c % e.layout.attn_tp for c in e.batch.tokens_per_dp()))
    assert any(c % ex.layout.attn_tp for c in ex.batch.tokens_per_dp())


def test_reaches_the_max_len_padding_mode():
    b = reach(batches(2), lambda b: padding_mode(b) == MAX_LEN)
    assert all(m in (DECODE, IDLE) for m in b.forward_modes())


def test_reaches_tp_dp_ep_equal_and_dp_lm_head():
    ex = reach(examples(tuple(FIXTURES), (4,), ("float32",), "model"),
               lambda e: e.layout.tp == e.layout.dp == e.layout.ep == 4)
    assert ex.layout.moe_tp == 1
    ex = reach(examples(tuple(FIXTURES), (2,), ("float32",), "model"), lambda e: e.layout.dp_lm_head)
    assert ex.layout.dp > 1


def test_reaches_kv_head_replication():
    ex = reach(examples(tuple(FIXTURES), (4,), ("float32",), "attention"),
               lambda e: FIXTURES[e.fixture].num_key_value_heads < e.layout.attn_tp)
    assert FIXTURES[ex.fixture].num_key_value_heads < ex.layout.attn_tp
