"""The job every rank runs for one example: build (once per layout) and run one unit of a target.

Inputs are rebuilt on each rank from (seed, shapes) instead of being shipped; only outputs travel back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import DTYPES, Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.poison import poisoned
from dpep_parity.checks.harness.recorder import setup_phase
from dpep_parity.checks.targets.protocol import (
    BuildEnv,
    Groups,
    HarnessFault,
    Serving,
    Step,
    harness_fault,
    resolve,
)


@functools.lru_cache(maxsize=4)
def load_weights(model_dir: str):
    from dpep_parity.fixtures.build import load_checkpoint
    return load_checkpoint(model_dir)


def make_groups(ctx, layout: Layout) -> Groups:
    """Create every group of the layout on every rank in one canonical order (torch requires it)."""
    ctx.recorder.forget_roles()
    mine = {}
    for name, groups in layout.all_groups().items():
        for ranks in groups:
            pg = ctx.group(ranks, name)
            if ctx.rank in ranks:
                mine[name] = (pg, ranks)
    return Groups(*(mine[n][0] for n in ("tp", "attn_tp", "moe_tp", "moe_ep")),
                  ranks={n: mine[n][1] for n in mine})


@dataclass(frozen=True)
class UnitJob:
    target: str
    unit: str
    model_dir: str
    layout: Layout
    batch: Batch
    dtype: str
    layer: int = 0
    token_ids: tuple[tuple[int, ...], ...] | None = None   # model unit: real prompts instead of seeded ids
    serving: tuple[Serving, ...] | None = None             # per DP rank: a step of a serving session
    poison: bool = False         # fresh float allocations hold NaN during build and run (checks.harness.poison)
    build_id: str = ""           # a fresh build for this id (a stateful run's own), else shared per layout

    def __call__(self, ctx) -> dict:
        try:
            return self._run(ctx)
        except HarnessFault:
            raise
        except Exception as e:
            target = ctx.cache.get(("target", self.target))
            if target is not None and harness_fault(target, e):
                raise HarnessFault(f"{type(e).__name__}: {e}") from e
            raise

    def _run(self, ctx) -> dict:
        if ctx.world_size != self.layout.tp:
            raise RuntimeError(f"world of {ctx.world_size} ranks cannot run layout {self.layout}")
        with setup_phase("loading the checkpoint"):
            config, weights = load_weights(self.model_dir)
        groups = make_groups(ctx, self.layout)
        key = ("built", self.target, self.unit, self.model_dir, self.layout, self.dtype, self.layer, self.build_id)
        if self.build_id:   # one stateful run's build at a time: drop the builds of earlier runs
            for k in [k for k in ctx.cache if k[0] == "built" and k[-1] and k[-1] != self.build_id]:
                del ctx.cache[k]
        if ("target", self.target) not in ctx.cache:
            ctx.cache[("target", self.target)] = resolve(self.target)
        if key not in ctx.cache:
            target = ctx.cache[("target", self.target)]
            dev = torch.device(ctx.device if ctx.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
            env = BuildEnv(config, weights, self.layout, ctx.rank, groups, DTYPES[self.dtype], dev, self.layer,
                           self.poison)
            with poisoned(self.poison), setup_phase(f"building {self.target}'s {self.unit} unit"):
                ctx.cache[key] = (target, target.build(self.unit, env))
        target, built = ctx.cache[key]
        dp_rank = self.layout.dp_rank(ctx.rank)
        batch = self.batch
        reqs: tuple[Request, ...] = batch.per_dp[dp_rank]
        unit = units.get(self.unit)
        if self.token_ids is not None:
            # this DP rank's requests only (converting every rank's, then slicing, was 4.5 % of a served
            # sign-off's CPU samples: docs/harness.md)
            seqs = [torch.tensor(t, dtype=torch.long) for t in self.token_ids[batch.local_slice(dp_rank)]]
            inputs = unit.inputs(seqs, config, DTYPES[self.dtype])
        else:
            inputs = unit.rank_inputs(batch, dp_rank, config, DTYPES[self.dtype])
        serving = self.serving[dp_rank] if self.serving is not None else None
        step = Step(batch, ctx.rank, dp_rank, reqs, inputs, self.unit, serving, self.poison)
        with poisoned(self.poison):
            return target.run(built, step)


class CollectiveSeconds:
    """Rank job: run `job` and return (its value, the host seconds this rank spent inside collectives)."""

    def __init__(self, job):
        self.job = job

    def __call__(self, ctx):
        value = self.job(ctx)
        return value, ctx.recorder.seconds
