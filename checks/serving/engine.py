"""The in-process serving engine: a target's whole model served over a world of ranks, step by step.

    engine = ServingEngine(model_dir, tp=4, dp=2, ep=2, target="spec", dtype="bfloat16")
    logits = engine.forward([[1, 2, 3], [4, 5]])            # every prompt position (log-likelihood)
    tokens = engine.generate([[1, 2, 3]], max_new=16, stop=[None])

Every step is one forward of the whole world (one UnitJob of the model unit): the scheduler's plan per DP
rank (prefill chunks, decode tokens, or nothing), the requests' token ids and, per DP rank, the serving
session's request ids and releases (`Step.serving`): targets with `sessions = True` keep each request's KV
cache across steps, others recompute prefixes. What the steps exercised is counted in `stats` (steps with a
decode rank, with an idle DP rank while others run, in MAX_LEN padding as the target reports it, ...).
"""
from __future__ import annotations

import uuid
from collections import Counter
from typing import Callable

import torch

from dpep_parity.checks.core.batches import DECODE, EXTEND, IDLE, MAX_LEN, Batch, Request, padding_mode
from dpep_parity.checks.core.topology import Layout, validate
from dpep_parity.checks.harness.unitjob import UnitJob, load_weights
from dpep_parity.checks.harness.world import get_world
from dpep_parity.checks.serving.scheduler import Plan, Scheduler, ServeRequest
from dpep_parity.checks.targets.protocol import Serving, resolve

STAT_KEYS = ("steps", "extend_steps", "decode_steps", "mixed_steps", "idle_rank_steps", "max_len_steps",
             "tokens")


class ServingEngine:
    def __init__(self, model_dir: str, tp: int = 1, dp: int = 1, ep: int = 1, target: str = "spec",
                 dtype: str = "float32", device: str = "cpu", deadline_s: float = 300.0,
                 policy: str = "round_robin", max_running: int = 32, max_prefill_tokens: int = 2048,
                 in_flight: int = 0):
        self.model_dir, self.target, self.dtype, self.device = str(model_dir), target, dtype, device
        config, _ = load_weights(self.model_dir)
        self.layout = validate(Layout(tp, dp, ep), config)
        tgt = resolve(target)   # fail before any rank starts
        # the protocol's `sessions`: only a target that keeps KV caches across steps gets the session's request
        # ids and releases; for others every step carries each request's tokens from its start (token_ids)
        self.sessions = bool(getattr(tgt, "sessions", False))
        self.name = f"{target}:{self.layout}:{dtype}"
        self.deadline_s = deadline_s
        self.policy, self.max_running, self.max_prefill_tokens = policy, max_running, max_prefill_tokens
        self.in_flight = in_flight
        Scheduler(dp, policy, max_running, max_prefill_tokens, in_flight)   # validates the settings now
        self.stats: Counter = Counter({k: 0 for k in STAT_KEYS})
        # called after every step with (plan, {dp rank: one of its ranks' model-unit outputs}): what the step
        # computed beyond the logits (the routing each token got: evals.near_ties)
        self.on_step: Callable[[Plan, dict], None] | None = None
        self.world = get_world(self.layout.tp, device, deadline_s, preload=getattr(tgt, "preload_modules", ()))

    # ------------------------------------------------------------------ the ForwardEngine protocol
    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        """Per request, float32 logits of every position (its prompt prefilled, nothing generated)."""
        reqs = [ServeRequest(list(t), prompt_logits=True) for t in requests]
        self.run(reqs)
        return [torch.cat(r.logits).float() for r in reqs]

    def generate(self, prompts: list[list[int]], max_new: int | list[int],
                 stop: list[Callable[[list[int]], bool] | None] | None = None) -> list[list[int]]:
        """Greedy generation: per prompt the tokens generated until `max_new` or its stop rule says so."""
        news = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
        stops = stop or [None] * len(prompts)
        reqs = [ServeRequest(list(p), max_new=n, stop=s) for p, n, s in zip(prompts, news, stops)]
        self.run(reqs)
        return [r.generated for r in reqs]

    def score_forced(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[tuple[float, bool]]]:
        """Teacher forcing: each continuation fed after its prompt one decode step at a time; per token its
        log-probability and whether it was the greedy choice."""
        reqs = [ServeRequest(list(p), forced=list(c)) for p, c in zip(prompts, continuations)]
        self.run(reqs)
        return [r.scores for r in reqs]

    def close(self) -> None:
        """Worlds are pooled per process and closed at exit; nothing to release per engine."""

    # ------------------------------------------------------------------ serving
    def run(self, requests: list[ServeRequest]) -> None:
        """Serve `requests` to completion (one serving session)."""
        if not requests:
            return
        sched = Scheduler(self.layout.dp, self.policy, self.max_running, self.max_prefill_tokens, self.in_flight)
        sched.submit(requests)
        longest = max(r.longest for r in requests)
        capacity = (self.max_running * longest, self.max_running, longest)
        session = uuid.uuid4().hex
        while sched.pending:
            plan = sched.plan()
            if not plan.runs:
                raise RuntimeError("serving: requests are pending but no DP rank has work")
            logits = self._step(plan, session, capacity)
            sched.complete(plan, logits)

    def _step(self, plan: Plan, session: str, capacity) -> list[list[torch.Tensor]]:
        lay = self.layout
        batch = Batch(tuple(tuple(Request(e.prefix, e.extend) for e in entries) for entries in plan.per_dp))
        ids = tuple(tuple(e.req.tokens[: e.prefix + e.extend]) for entries in plan.per_dp for e in entries)
        serving = tuple(Serving(session, tuple(e.req.rid for e in entries), tuple(plan.released[d]), capacity)
                        for d, entries in enumerate(plan.per_dp)) if self.sessions else None
        job = UnitJob(self.target, "model", self.model_dir, lay, batch, self.dtype, token_ids=ids,
                      serving=serving)
        results = self.world.run(job)
        by_dp = {}
        for r in results:           # the DP group's ranks return the same logits: take one per DP rank
            by_dp.setdefault(lay.dp_rank(r.rank), r.value)
        self._count(batch, {v.get("padding_mode") for v in by_dp.values()})
        if self.on_step is not None:
            self.on_step(plan, by_dp)
        out = []
        for d, entries in enumerate(plan.per_dp):
            rows = by_dp[d]["logits"]
            out.append(list(rows.split([e.extend for e in entries])) if entries else [])
        return out

    def _count(self, batch: Batch, reported: set) -> None:
        modes = batch.forward_modes()
        s = self.stats
        s["steps"] += 1
        s["tokens"] += sum(batch.tokens_per_dp())
        s["extend_steps"] += EXTEND in modes
        s["decode_steps"] += DECODE in modes
        s["mixed_steps"] += EXTEND in modes and DECODE in modes
        s["idle_rank_steps"] += IDLE in modes
        mode = (reported - {None}) or {padding_mode(batch) if self.layout.dp > 1 else None}
        s["max_len_steps"] += MAX_LEN in mode
