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
