"""Small picklable rank jobs for the harness's own tests (targets of the world, not of the suite)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SumRanks:
    """Every rank all-reduces its rank number: the sum comes back on every rank."""
    def __call__(self, ctx):
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t)
        return float(t)


@dataclass(frozen=True)
class SkipOnRank:
    """Rank `idle` skips the all-reduce the others enter: the idle-rank hang (bug B02)."""
    idle: int

    def __call__(self, ctx):
        t = torch.ones(3)
        if ctx.rank != self.idle:
            dist.all_reduce(t)
        return float(t.sum())


@dataclass(frozen=True)
class RaiseOnRank:
    bad: int

    def __call__(self, ctx):
        if ctx.rank == self.bad:
            raise ValueError(f"boom on rank {ctx.rank}")
        t = torch.ones(2)
        dist.all_reduce(t)
        return 0


@dataclass(frozen=True)
class ShapeMismatch:
    """Rank 0 all-gathers a different shape than the others."""
    def __call__(self, ctx):
        n = 3 if ctx.rank == 0 else 2
        out = torch.empty(ctx.world_size * n)
        dist.all_gather_into_tensor(out, torch.ones(n))
        return 0


@dataclass(frozen=True)
class Sleep:
    seconds: float

    def __call__(self, ctx):
        import time
        time.sleep(self.seconds)
        return ctx.rank


@dataclass(frozen=True)
class LoadedModules:
    """Which of `names` the rank had imported before this job ran, and its value of environment variable `env`."""
    names: tuple[str, ...]
    env: str = ""

    def __call__(self, ctx):
        import os
        import sys
        return [n in sys.modules for n in self.names], os.environ.get(self.env) if self.env else None


@dataclass(frozen=True)
class SleepInSetup:
    """Every rank spends `setup` seconds in a marked set-up phase, then `after` seconds outside it."""
    setup: float
    after: float = 0.0

    def __call__(self, ctx):
        import time

        from dpep_parity.checks.harness.recorder import setup_phase
        with setup_phase("a slow import"):
            time.sleep(self.setup)
        time.sleep(self.after)
        return ctx.rank


@dataclass(frozen=True)
class SeesFile:
    """Every rank waits up to `wait_s` for `path` to appear (written by the test process meanwhile) and
    returns whether it did: true only when the test process worked while the ranks ran."""
    path: str
    wait_s: float

    def __call__(self, ctx):
        import os
        import time
        end = time.monotonic() + self.wait_s
        while time.monotonic() < end:
            if os.path.exists(self.path):
                return True
            time.sleep(0.01)
        return False
