"""Which requests run in a step, on which DP rank, and how far: the scheduling of a DP-attention engine
(pure bookkeeping: no torch import, no world; the engine runs the plans it makes).

- A DP controller hands every request to a DP rank when it arrives, as SGLang's DP controller does:
  `round_robin` cycles over the ranks, `shortest_queue` picks the rank with the fewest requests assigned and
  not finished (SGLang's two load-balancing methods). Each DP rank runs at most `max_running` of its requests
  at once; the rest wait in its own queue. So DP ranks whose requests are shorter run out of work first and
  sit idle while others still decode, as in a real DP-attention deployment.
- Each DP rank's scheduler prefers prefill, as SGLang's does by default: while it has requests whose prompt
  is not fully in the cache it extends them (prompt chunks within `max_prefill_tokens` per step: a long
  prompt continues after its cached prefix in the next step, SGLang's chunked prefill); otherwise every
  running request decodes one token; with neither it is idle for the step, while other DP ranks run.
- Continuous batching: a request that finishes frees its slot at once, and its DP rank starts the next of
  its waiting requests in the following step.
- A client with `in_flight` > 0 keeps at most that many requests in the engine (lm-eval's `num_concurrent`
  against a server): the next one arrives when one finishes, and goes to the next DP rank in turn, not to
  the one that freed up. At low concurrency DP ranks go idle while others decode in most steps, as in a
  deployment under light load; 0 sends every request at once.

A request wants the logits of every prompt position (log-likelihood), or greedy tokens after its prompt
(generation, until `max_new` tokens or its stop rule), or given tokens fed after its prompt one decode step
at a time (teacher forcing: `forced`), with each one's log-probability and whether it was the greedy choice.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

POLICIES = ("round_robin", "shortest_queue")


@dataclass(eq=False)
class ServeRequest:
    prompt: list[int]
    max_new: int = 0                                   # greedy tokens to generate after the prompt
    prompt_logits: bool = False                        # keep the logits of every prompt position
    stop: Callable[[list[int]], bool] | None = None    # after each new token, on the tokens generated so far
    forced: list[int] | None = None                    # teacher forcing: these tokens follow the prompt
    rid: int = -1
    # progress
    dp: int | None = None
    computed: int = 0                                  # tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    logits: list["torch.Tensor"] = field(default_factory=list)   # prompt logits, chunk by chunk
    scores: list[tuple[float, bool]] = field(default_factory=list)  # forced tokens: (log-prob, greedy)
    done: bool = False

    def __post_init__(self):
        if self.forced is not None:
            self.max_new = len(self.forced)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def longest(self) -> int:
        """Tokens this request can hold in the cache: the prompt and every generated token but the last."""
        return len(self.prompt) + max(self.max_new - 1, 0)


@dataclass(frozen=True)
class Entry:
    """One request's part of a step: `extend` tokens after `prefix` cached ones."""
    req: ServeRequest
    prefix: int
    extend: int


@dataclass
class Plan:
    per_dp: list[list[Entry]]
    released: list[list[int]]          # per DP rank: ids finished since the previous step

    @property
    def runs(self) -> bool:
        return any(self.per_dp)


class Scheduler:
    def __init__(self, dp: int, policy: str = "round_robin", max_running: int = 32, max_prefill_tokens: int = 2048,
                 in_flight: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r}: expected one of {POLICIES}")
        if max_running < 1 or max_prefill_tokens < 1:
            raise ValueError("max_running and max_prefill_tokens must be positive")
        if in_flight < 0:
            raise ValueError("in_flight must be >= 0 (0: every request at once)")
        self.in_flight = in_flight
        self.backlog: deque[ServeRequest] = deque()                         # not yet sent by the client
        self.dp, self.policy = dp, policy
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.queue: deque[ServeRequest] = deque()                           # arrived, not dispatched
        self.waiting: list[deque[ServeRequest]] = [deque() for _ in range(dp)]   # dispatched, not running
        self.resident: list[list[ServeRequest]] = [[] for _ in range(dp)]   # running, not finished
        self.released: list[list[int]] = [[] for _ in range(dp)]
        self._cursor = 0
        self._next_id = 0

    def submit(self, requests: list[ServeRequest]) -> None:
        for r in requests:
            if not r.prompt:
                raise ValueError("a request needs at least one prompt token")
            r.rid, self._next_id = self._next_id, self._next_id + 1
            self.backlog.append(r)

    @property
    def pending(self) -> bool:
        return bool(self.backlog) or bool(self.queue) or any(self.waiting) or any(self.resident)

    # ------------------------------------------------------------------ planning
    def _dispatch(self) -> None:
        engine_holds = len(self.queue) + sum(map(len, self.waiting)) + sum(map(len, self.resident))
        while self.backlog and (not self.in_flight or engine_holds < self.in_flight):
            self.queue.append(self.backlog.popleft())
            engine_holds += 1
        while self.queue:
            if self.policy == "shortest_queue":
                load = [len(self.waiting[k]) + len(self.resident[k]) for k in range(self.dp)]
                d = min(range(self.dp), key=lambda k: (load[k], (k - self._cursor) % self.dp))
            else:
                d = self._cursor
            self._cursor = (d + 1) % self.dp
            r = self.queue.popleft()
            r.dp = d
            self.waiting[d].append(r)
        for d in range(self.dp):
            while self.waiting[d] and len(self.resident[d]) < self.max_running:
                self.resident[d].append(self.waiting[d].popleft())

    def plan(self) -> Plan:
        """The next step: per DP rank its entries (prefill chunks, else one decode token per running request,
        else nothing), and the ids released since the previous step."""
        self._dispatch()
        per_dp = []
        for d in range(self.dp):
            entries, budget = [], self.max_prefill_tokens
            for r in self.resident[d]:
                if r.prefilling and budget > 0:
                    n = min(len(r.prompt) - r.computed, budget)
                    entries.append(Entry(r, r.computed, n))
                    budget -= n
            if not entries:
                entries = [Entry(r, r.computed, 1) for r in self.resident[d] if not r.prefilling]
            per_dp.append(entries)
        released, self.released = self.released, [[] for _ in range(self.dp)]
        return Plan(per_dp, released)

    # ------------------------------------------------------------------ results
    def complete(self, plan: Plan, logits: list[list["torch.Tensor"]]) -> list[ServeRequest]:
        """logits[d][i]: the rows the step computed for entry i of DP rank d ([extend, vocab]). Returns the
        requests that finished in this step."""
        finished = []
        for d, entries in enumerate(plan.per_dp):
            for e, rows in zip(entries, logits[d]):
                r = e.req
                if rows.shape[0] != e.extend:
                    raise RuntimeError(f"request {r.rid}: {rows.shape[0]} logit rows for {e.extend} tokens")
                if e.prefix < len(r.prompt) and r.prompt_logits:
                    r.logits.append(rows)
                r.computed = e.prefix + e.extend
                if r.prefilling:
                    continue                                   # a prompt chunk: more to come
                if len(r.generated) < r.max_new:
                    greedy = int(rows[-1].argmax())
                    if r.forced is None:
                        r.generated.append(greedy)
                    else:
                        tok = r.forced[len(r.generated)]
                        r.scores.append((float(rows[-1].float().log_softmax(-1)[tok]), greedy == tok))
                        r.generated.append(tok)
                if len(r.generated) >= r.max_new or (r.stop is not None and r.generated and r.stop(r.generated)):
                    r.done = True
                    self.resident[d].remove(r)
                    self.released[d].append(r.rid)
                    finished.append(r)
        return finished
