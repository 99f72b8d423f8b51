"""Negative controls for the exact checks of checks.judge.parity that no mutant reaches first in the kill
table: greedy tokens and collective discipline from the records."""
from __future__ import annotations

import torch

from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.recorder import Record
from dpep_parity.checks.harness.world import RankResult
from dpep_parity.checks.judge.parity import collective_discipline, greedy_check


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


def test_routing_flip_away_from_a_tie_is_judged_not_excused():
    """A target that reports other experts than one device on a decided row fails the routing check and
    keeps that row under the parity check; only a flip on a near-tie row excuses it."""
    from dpep_parity.checks.core.batches import Batch, Request
    from dpep_parity.checks.judge.parity import routing_analysis
    from dpep_parity.checks.oracle.reference import UnitRef
    probs = torch.tensor([[0.50, 0.30, 0.15, 0.05],       # row 0: top-2 {0, 1}, decided
                          [0.40, 0.30, 0.30 - 1e-12, 0.0]],  # row 1: experts 1 and 2 tie for place 2
                         dtype=torch.float64)
    probs[1, 3] = 1 - probs[1, :3].sum()
    uref = UnitRef(torch.zeros(2, 4), torch.zeros(2, 4), router=[([probs], [probs.float()])])
    batch, lay = Batch(((Request(0, 2),),)), Layout(1)
    cfg = {"num_hidden_layers": 1, "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}

    def analyse(ids):
        res = [RankResult(0, {"routing": {0: torch.tensor(ids)}}, [], 0.0)]
        return routing_analysis(res, uref, batch, lay, "moe", 0, cfg, 2, torch.float32)

    same = analyse([[0, 1], [0, 1]])
    assert same.check.ok and not same.excused.any()
    tie_flip = analyse([[0, 1], [0, 2]])
    assert tie_flip.check.ok and tie_flip.excused.tolist() == [False, True]
    away = analyse([[0, 2], [0, 1]])
    assert not away.check.ok and "not near a tie" in away.check.message
    assert not away.excused.any()          # row 0 stays judged: its parity failure shows the damage


def test_a_whole_models_routing_walk_takes_a_request_that_extends_no_rows():
    """A replayed batch may hold a request of 0 extend rows after a cached prefix (`dp0:2+0,...`): the model's
    per-request walk reads its last 0 rows (`ties[-0:]` read the whole prefix and broke the comparison), and a
    flip away from a tie on the next request is still found."""
    from dpep_parity.checks.core.batches import Batch, Request
    from dpep_parity.checks.judge.parity import routing_analysis
    from dpep_parity.checks.oracle.reference import UnitRef
    decided = torch.tensor([0.50, 0.30, 0.15, 0.05], dtype=torch.float64)
    batch, lay = Batch(((Request(3, 0), Request(0, 2)),)), Layout(1)
    router = [([decided.repeat(3, 1), decided.repeat(2, 1)], [decided.repeat(3, 1), decided.repeat(2, 1)])]
    uref = UnitRef(torch.zeros(2, 4), torch.zeros(2, 4), router=router)
    cfg = {"num_hidden_layers": 1, "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}

    def analyse(ids):
        res = [RankResult(0, {"routing": {0: torch.tensor(ids)}}, [], 0.0)]
        return routing_analysis(res, uref, batch, lay, "model", 0, cfg, 2, torch.float32)

    assert analyse([[0, 1], [0, 1]]).check.ok
    away = analyse([[0, 1], [0, 2]])
    assert not away.check.ok and "request 1 token 1" in away.check.message


def test_a_parity_failure_with_routing_away_from_ties_names_routing_as_the_likely_cause():
    """B03 (heads duplicated) routes decided rows elsewhere: the rows stay judged (no '|sut|/|truth| = nan' pass
    on excused rows), parity fails, and its message points at the routing difference."""
    from dpep_parity.checks.core.batches import Batch, Request
    from dpep_parity.checks.judge.parity import run_example
    from dpep_parity.fixtures.build import fixture_path
    batch = Batch(((Request(4, 1), Request(2, 1), Request(5, 1)), (Request(3, 1),)), 5)
    res = run_example("checks.catalog.mutants:B03", "moe", str(fixture_path("qwen3-moe")), Layout(4, 2, 2), batch,
                      "float32", 1)
    failed = {c.prop: c.message for c in res.failures()}
    assert {"routing", "parity"} <= set(failed), res.report()
    assert "likely cause: the target routed rows to other experts" in failed["parity"]
    assert res.verdict.ratio == res.verdict.ratio                  # judged on real rows, not all excused (nan)


def test_padding_rule_holds_a_target_to_its_own_tie_policy():
    from types import SimpleNamespace

    from dpep_parity.checks.core.batches import MAX_LEN, SUM_LEN, padding_mode, parse_batch
    from dpep_parity.checks.targets.protocol import padding_ties
    tie = parse_batch("dp0:2+1,3+1,4+1 dp1:idle seed=23")        # decode 3 rows + idle: 3 * 2 == 3 * 2
    assert padding_mode(tie) == MAX_LEN and padding_mode(tie, SUM_LEN) == SUM_LEN
    cheap_max = parse_batch("dp0:2+1,3+1 dp1:4+1,5+1 seed=1")     # 4 * 2 > 2 * 2: no tie, MAX_LEN for both
    cheap_sum = parse_batch("dp0:2+1,3+1,4+1 dp1:idle dp2:idle dp3:idle seed=1")   # 3 * 2 < 3 * 4
    extend = parse_batch("dp0:0+3 dp1:idle seed=1")              # an extend: SUM_LEN whatever the ties
    for ties in (MAX_LEN, SUM_LEN):
        assert padding_mode(cheap_max, ties) == MAX_LEN
        assert padding_mode(cheap_sum, ties) == SUM_LEN
        assert padding_mode(extend, ties) == SUM_LEN
    assert padding_ties(SimpleNamespace()) == MAX_LEN                         # the protocol's default
    assert padding_ties(SimpleNamespace(padding_ties=SUM_LEN)) == SUM_LEN


def test_sglang_releases_before_0_5_10_break_padding_ties_toward_sum_len():
    # 0.5.9 layers/dp_attention.py:72 `sum_len * 2 > max_len * dp` ; 0.5.10: `>=` (read in the wheels)
    from dpep_parity.checks.targets.sglang import eras
    assert [eras.adapter(v).padding_ties for v in ("0.5.8", "0.5.9", "0.5.10", "0.5.23")] == \
        ["sum_len", "sum_len", "max_len", "max_len"]


def test_padding_rule_at_a_tie_passes_a_declared_policy_and_fails_an_undeclared_or_unkept_one():
    from dpep_parity.checks.core.batches import parse_batch
    from dpep_parity.checks.judge.parity import run_example
    from dpep_parity.fixtures.build import fixture_path
    model, tie = str(fixture_path("qwen3-moe")), parse_batch("dp0:2+1,3+1,4+1 dp1:idle seed=23")

    def rule(target):
        res = run_example(f"dpep_parity.checks.tests.ties_target:{target}", "moe", model, Layout(2, 2, 1), tie,
                          "float32", 1, deadline_s=120)
        return {c.prop: c.ok for c in res.checks}["padding-rule"]
    assert rule("TARGET")               # positive control: SUM_LEN at the tie, declared
    assert not rule("UNDECLARED")       # the same padding, not declared: the default MAX_LEN policy is broken
    assert not rule("DECLARED_ONLY")    # declared SUM_LEN, pads MAX_LEN (the spec's policy): not kept


def test_dispatch_counts_pass_the_oracles_routing_and_flag_padded_rows_and_unknown_experts():
    """The per-expert dispatch counts: the oracle's own routing passes (split over two EP ranks, counts keyed by
    int or str); a padded row dispatched to an expert fails; an expert id outside the model fails by name."""
    from dpep_parity.checks.core.batches import Batch, Request
    from dpep_parity.checks.judge.parity import dispatch_check
    from dpep_parity.checks.oracle.reference import UnitRef
    probs = torch.tensor([[0.50, 0.30, 0.15, 0.05],
                          [0.10, 0.20, 0.30, 0.40],
                          [0.05, 0.60, 0.25, 0.10]], dtype=torch.float64)   # top-2: {0,1}, {3,2}, {1,2}
    uref = UnitRef(torch.zeros(3, 4), torch.zeros(3, 4), [([probs], [probs])])
    batch, lay, config = Batch(((Request(0, 3),),), seed=0), Layout(2, 1, 2), {"num_experts": 4}
    none = torch.zeros(3, dtype=torch.bool)

    def check(*per_rank):
        return dispatch_check([RankResult(r, {"expert_counts": c}, [], 0.0) for r, c in enumerate(per_rank)],
                              uref, lay, config, batch, torch.float32, none, 2)
    assert check({0: 1, 1: 2}, {"2": 2, "3": 1}).ok
    padded = check({0: 2, 1: 2}, {2: 2, 3: 1})          # a pad row routed to expert 0
    assert not padded.ok and "+1 rows" in padded.message
    unknown = check({0: 1, 1: 2}, {2: 2, 3: 1, 4: 1})
    assert not unknown.ok and "[4]" in unknown.message and "outside 0..3" in unknown.message
