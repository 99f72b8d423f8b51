"""An in-process parallel engine: a target's whole model across a world, for end-to-end evals.

`ModelServer(model_dir, tp=4, dp=2, ep=2, target="spec").forward(requests)` spreads the requests over the
DP ranks (round-robin, as a DP controller would), runs one prefill forward on every rank and returns the
float32 logits of every position of every request, in request order.
"""
from __future__ import annotations

import torch

from checks.batches import Batch, Request
from checks.targets.protocol import resolve
from checks.topology import Layout, validate
from checks.unitjob import UnitJob, load_weights
from checks.world import get_world


class ModelServer:
    def __init__(self, model_dir: str, tp: int = 1, dp: int = 1, ep: int = 1, target: str = "spec",
                 dtype: str = "float32", device: str = "cpu", deadline_s: float = 300.0,
                 max_tokens_per_forward: int = 4096):
        self.model_dir, self.target, self.dtype, self.device = str(model_dir), target, dtype, device
        config, _ = load_weights(self.model_dir)
        self.layout = validate(Layout(tp, dp, ep), config)
        resolve(target)   # fail before any rank starts
        self.name = f"{target}:{self.layout}:{dtype}"
        self.deadline_s, self.max_tokens = deadline_s, max_tokens_per_forward
        self.world = get_world(self.layout.tp, device, deadline_s)

    def forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        chunk: list[list[int]] = []
        for req in requests:   # bound the tokens of one forward
            if chunk and sum(map(len, chunk)) + len(req) > self.max_tokens:
                out += self._forward(chunk)
                chunk = []
            chunk.append(req)
        return out + (self._forward(chunk) if chunk else [])

    def _forward(self, requests: list[list[int]]) -> list[torch.Tensor]:
        dp = self.layout.dp
        owner = [i % dp for i in range(len(requests))]
        per_dp = tuple(tuple(Request(0, len(requests[i])) for i in range(len(requests)) if owner[i] == d)
                       for d in range(dp))
        order = [i for d in range(dp) for i in range(len(requests)) if owner[i] == d]
        ids = tuple(tuple(requests[i]) for i in order)
        job = UnitJob(self.target, "model", self.model_dir, self.layout, Batch(per_dp), self.dtype,
                      token_ids=ids)
        results = get_world(self.layout.tp, self.device, self.deadline_s).run(job)
        by_dp = {self.layout.dp_rank(r.rank): r.value["logits"] for r in reversed(results)}
        rows = torch.cat([by_dp[d] for d in range(dp)]).float()
        pieces = rows.split([len(requests[i]) for i in order])
        result: list[torch.Tensor] = [torch.empty(0)] * len(requests)
        for i, p in zip(order, pieces):
            result[i] = p
        return result

    def close(self) -> None:
        """Worlds are pooled per process and closed at exit; nothing to release per server."""
