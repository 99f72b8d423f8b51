"""The in-process serving engine (checks.serving): the scheduler's plans, and served steps over a world that
really take the DP-attention paths (decode steps, an idle DP rank while another decodes, MAX_LEN padding,
a prefill on one DP rank while another decodes), counted by the engine, with results equal to one device's.

Positive controls: the spec target served with either scheduling policy generates what transformers'
float64 model generates greedily, and its logits pass the tolerance model. Negative control: mutant M07
(wrong only in decode steps with an idle DP rank) is caught by the served engine, and is invisible to
full-forward generation (the prefill-only path the evals used before), which is why the evals now serve.
"""
from __future__ import annotations

import pytest
import torch

from dpep_parity.checks.core import numerics
from dpep_parity.checks.serving.engine import ServingEngine
from dpep_parity.checks.serving.scheduler import Scheduler, ServeRequest
from dpep_parity.fixtures.build import fixture_path

VOCAB = 16


def _logits(plan, token=3):
    """Fake model output for a plan: every row's greedy token is `token`."""
    out = []
    for entries in plan.per_dp:
        rows = []
        for e in entries:
            t = torch.zeros(e.extend, VOCAB)
            t[:, token] = 1.0
            rows.append(t)
        out.append(rows)
    return out


# ---------------------------------------------------------------------------------------------- scheduler
def test_round_robin_admits_as_slots_free():
    s = Scheduler(dp=2, policy="round_robin", max_running=1)
    reqs = [ServeRequest([1, 2], max_new=n) for n in (1, 3, 2)]
    s.submit(reqs)
    plan = s.plan()
    assert [r.dp for r in reqs] == [0, 1, 0]                  # dispatched on arrival, round robin
    assert [[e.req for e in entries] for entries in plan.per_dp] == [[reqs[0]], [reqs[1]]]   # third waits
    s.complete(plan, _logits(plan))                   # prefill: request 0 (max_new 1) finishes at once
    assert reqs[0].done and reqs[0].generated == [3]
    plan = s.plan()
    assert plan.released == [[reqs[0].rid], []]               # request 0's slot went to request 2
    kinds = [[(e.prefix, e.extend) for e in entries] for entries in plan.per_dp]
    assert kinds == [[(0, 2)], [(2, 1)]]               # dp0 prefills request 2 while dp1 decodes request 1


def test_shortest_queue_and_idle_ranks():
    s = Scheduler(dp=3, policy="shortest_queue", max_running=4)
    s.submit([ServeRequest([1], max_new=1)])
    plan = s.plan()
    assert [len(e) for e in plan.per_dp] == [1, 0, 0]        # two DP ranks idle in this step
    s.submit([ServeRequest([1], max_new=1), ServeRequest([1], max_new=1)])
    plan2 = s.plan()
    assert [len(e) for e in plan2.per_dp] == [1, 1, 1]       # newcomers go to the emptier ranks


def test_a_rank_whose_requests_end_first_idles_while_others_decode():
    s = Scheduler(dp=2, policy="round_robin", max_running=1)
    s.submit([ServeRequest([1], max_new=n) for n in (1, 4, 1, 4)])     # dp0 gets the short ones
    sizes = []
    while s.pending:
        plan = s.plan()
        sizes.append([len(e) for e in plan.per_dp])
        s.complete(plan, _logits(plan))
    assert sizes[-1] == [0, 1] and [0, 1] in sizes[:-1]

def test_a_client_with_few_requests_in_flight_leaves_dp_ranks_idle():
    s = Scheduler(dp=2, policy="round_robin", in_flight=2)
    reqs = [ServeRequest([1], max_new=n) for n in (2, 5, 2, 5, 2)]
    s.submit(reqs)
    held, idle_decodes = [], 0
    while s.pending:
        plan = s.plan()
        held.append(sum(map(len, plan.per_dp)))
        idle_decodes += any(not e for e in plan.per_dp) and any(e and e[0].prefix for e in plan.per_dp)
        s.complete(plan, _logits(plan))
    assert max(held) == 2 and [r.dp for r in reqs] == [0, 1, 0, 1, 0]
    assert idle_decodes > 0 and all(r.done for r in reqs)


def test_chunked_prefill_then_decode_then_forced_tokens():
    s = Scheduler(dp=1, max_prefill_tokens=4)
    r = ServeRequest(list(range(10)), forced=[5, 3], prompt_logits=True)
    s.submit([r])
    spans = []
    while s.pending:
        plan = s.plan()
        spans.append([(e.prefix, e.extend) for e in plan.per_dp[0]])
        s.complete(plan, _logits(plan))
    assert spans == [[(0, 4)], [(4, 4)], [(8, 2)], [(10, 1)]]
    assert sum(t.shape[0] for t in r.logits) == 10
    assert r.generated == [5, 3] and [g for _, g in r.scores] == [False, True]


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(2, policy="fastest")
    with pytest.raises(ValueError, match="positive"):
        Scheduler(2, max_running=0)
    with pytest.raises(ValueError, match="in_flight"):
        Scheduler(2, in_flight=-1)
    with pytest.raises(ValueError, match="prompt token"):
        Scheduler(2).submit([ServeRequest([])])


# ---------------------------------------------------------------------------------------------- served steps
PROMPTS = [[5, 9, 3, 12, 7], [4, 100, 33], [17, 2, 250, 61, 8, 90, 11, 3, 41], [6, 6], [301, 14, 77, 5]]
NEW = [9, 2, 6, 12, 4]        # different lengths: DP ranks run out of work at different steps


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    path = str(fixture_path("qwen2-moe-shared"))
    hf = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt, experts_implementation="eager").eval()
          for dt in (torch.float64, torch.float32)}
    return path, hf


def _greedy(hf, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _served(path, target, policy="round_robin", **kw):
    return ServingEngine(path, tp=2, dp=2, ep=1, target=target, dtype="float32", policy=policy,
                         max_running=2, max_prefill_tokens=8, deadline_s=120, **kw)


def _sglang_missing():
    from dpep_parity.checks.targets.sglang import unavailable_reason

    return unavailable_reason()


@pytest.mark.parametrize("target, policy", [
    ("spec", "round_robin"), ("spec", "shortest_queue"),
    pytest.param("sglang", "round_robin", marks=pytest.mark.skipif(
        _sglang_missing() is not None, reason=f"sglang: {_sglang_missing()}")),
])
@pytest.mark.slow
def test_served_generation_matches_one_device_and_takes_the_dp_paths(model, target, policy):
    """sglang: SGLang's own model keeps the sessions' KV caches in its ReqToTokenPool / KV pool slots."""
    path, hf = model
    engine = _served(path, target, policy)
    got = engine.generate(PROMPTS, NEW)
    assert got == [_greedy(hf[torch.float64], p, n) for p, n in zip(PROMPTS, NEW)]
    st = engine.stats
    assert st["decode_steps"] > 0 and st["idle_rank_steps"] > 0 and st["max_len_steps"] > 0, dict(st)
    assert st["mixed_steps"] > 0, dict(st)          # a DP rank prefills while the other decodes
    assert st["extend_steps"] + st["decode_steps"] - st["mixed_steps"] == st["steps"], dict(st)


def test_served_logits_pass_the_tolerance_model(model):
    path, hf = model
    logits = _served(path, "spec").forward(PROMPTS)       # prompts prefilled in chunks over cached prefixes
    with torch.no_grad():
        for p, lg in zip(PROMPTS, logits):
            ids = torch.tensor([p])
            truth, ref = (hf[dt](input_ids=ids).logits[0] for dt in (torch.float64, torch.float32))
            v = numerics.compare("logits", lg, truth, ref, torch.float32, fan_in=2)   # tp=2 partial sums
            assert v.ok, str(v)


def test_a_target_without_sessions_is_served_whole_prefixes_and_generates_the_same(model):
    """The protocol's `sessions`: a target that does not declare it gets no serving session and recomputes
    each request's prefix every step (positive control: it generates what one device does); the same code
    declaring sessions is sent them (negative control: it refuses them, so the flag is what the engine read)."""
    path, hf = model
    engine = _served(path, "dpep_parity.checks.tests.sessionless_target:TARGET")
    assert not engine.sessions and _served(path, "spec").sessions
    assert engine.generate(PROMPTS, NEW) == [_greedy(hf[torch.float64], p, n) for p, n in zip(PROMPTS, NEW)]
    assert engine.stats["decode_steps"] > 0
    with pytest.raises(Exception, match="keeps no KV cache"):
        _served(path, "dpep_parity.checks.tests.sessionless_target:CLAIMS").generate(PROMPTS[:1], [2])


def test_decode_only_fault_is_caught_served_and_missed_by_full_forwards(model):
    path, hf = model
    want = [_greedy(hf[torch.float64], p, n) for p, n in zip(PROMPTS, NEW)]
    engine = _served(path, "checks.catalog.mutants:M07")
    assert engine.generate(PROMPTS, NEW) != want
    assert engine.stats["idle_rank_steps"] > 0

    def by_forwards(prompt, n):         # how the evals generated before: a full prefill per new token
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(engine.forward([ids])[0][-1].argmax()))
        return ids[len(prompt):]
    assert [by_forwards(p, n) for p, n in zip(PROMPTS, NEW)] == want
