"""Extra picklable rank jobs for checks/tests/test_world.py (a module file: spawned ranks import it)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PidAndSum:
    """(this rank's pid, its rank, the all-reduced sum of ranks): proves which process ran the job."""
    def __call__(self, ctx):
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t)
        return os.getpid(), ctx.rank, float(t)


@dataclass(frozen=True)
class ReduceOnRole:
    """Build the groups of `layout` (checks.unitjob.make_groups) and all-reduce once on the group of `role`;
    rank `idle` skips it (a hang whose diagnosis must name the group's every role)."""
    layout: object
    role: str
    idle: int = -1

    def __call__(self, ctx):
        from dpep_parity.checks.unitjob import make_groups
        groups = make_groups(ctx, self.layout)
        if ctx.rank != self.idle:
            dist.all_reduce(torch.ones(2), group=getattr(groups, self.role))
        return 0


@dataclass(frozen=True)
class DieOnRank:
    """Rank `bad`'s process ends abruptly (a segfault's kind of death) while the others enter an all-reduce."""
    bad: int

    def __call__(self, ctx):
        if ctx.rank == self.bad:
            os._exit(3)
        dist.all_reduce(torch.ones(2))
        return 0
