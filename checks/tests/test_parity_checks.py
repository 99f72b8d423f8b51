"""Negative controls for the exact checks of checks.parity that no mutant reaches first in the kill
table: greedy tokens and collective discipline from the records."""
from __future__ import annotations

import torch

from checks.parity import collective_discipline, greedy_check
from checks.recorder import Record
from checks.topology import Layout
from checks.world import RankResult


def _logits():
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(6, 32, generator=g, dtype=torch.float64)
    truth[:, 5] += 10.0                    # a decided argmax on every row
    truth[4, 7] = truth[4, 5] - 1e-9       # row 4: a top-2 tie within any noise
    ref = truth.float()
    return truth, ref


def test_greedy_flags_a_changed_decided_token_only():
    truth, ref = _logits()
    none = torch.zeros(6, dtype=torch.bool)
    labels = [f"row {i}" for i in range(6)]
    assert greedy_check(truth.float(), truth, ref, none, torch.float32, labels).ok
    tie_flip = truth.float().clone()
    tie_flip[4, 7] += 1.0                  # the tied row picks the other token: legitimate
    assert greedy_check(tie_flip, truth, ref, none, torch.float32, labels).ok
    wrong = truth.float().clone()
    wrong[2, 9] += 20.0                    # a decided row picks another token: a bug
    c = greedy_check(wrong, truth, ref, none, torch.float32, labels)
    assert not c.ok and "row 2" in c.message


def _rec(seq, shape, gseq=None, op="all_reduce"):
    return Record(seq, op, (0, 1), "tp", gseq or seq, (shape,), "float32", "x.py:1 (f)")


def test_collective_discipline_flags_mismatch_and_skip():
    lay = Layout(2, 2)
    same = [RankResult(r, {}, [_rec(1, (4, 8)), _rec(2, (4, 8))], 0.0) for r in (0, 1)]
    assert collective_discipline(same, lay).ok
    shapes = [RankResult(0, {}, [_rec(1, (4, 8))], 0.0), RankResult(1, {}, [_rec(1, (3, 8))], 0.0)]
    c = collective_discipline(shapes, lay)
    assert not c.ok and "(3, 8)" in c.message and "(4, 8)" in c.message
    skipped = [RankResult(0, {}, [_rec(1, (4, 8)), _rec(2, (4, 8))], 0.0),
               RankResult(1, {}, [_rec(1, (4, 8))], 0.0)]
    c = collective_discipline(skipped, lay)
    assert not c.ok and "skipped" in c.message
