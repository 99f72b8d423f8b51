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
    """Build the groups of `layout` (checks.harness.unitjob.make_groups) and all-reduce once on the group of `role`;
    rank `idle` skips it (a hang whose diagnosis must name the group's every role)."""
    layout: object
    role: str
    idle: int = -1

    def __call__(self, ctx):
        from dpep_parity.checks.harness.unitjob import make_groups
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


@dataclass(frozen=True)
class SGLangLoaderWrites:
    """Build SGLang's model at `layout` (a fresh session: checks.targets.sglang.session), then hand the model
    class's own `load_weights` a copy of the checkpoint directly, and return this rank's names of the tensors
    the load changed in that copy: a loader that writes into its input (finding F10)."""
    model_dir: str
    layout: object
    dtype: str = "float32"

    def __call__(self, ctx):
        from dpep_parity.checks.core.batches import DTYPES
        from dpep_parity.checks.harness.unitjob import load_weights, make_groups
        from dpep_parity.checks.targets.protocol import BuildEnv
        from dpep_parity.checks.targets.sglang import session
        config, weights = load_weights(self.model_dir)
        groups = make_groups(ctx, self.layout)
        handed = {name: t.clone() for name, t in weights.items()}
        env = BuildEnv(config, weights, self.layout, ctx.rank, groups, DTYPES[self.dtype], torch.device("cpu"), 0)
        session._teardown_at_exit()       # a session of this key from an earlier example would not load again
        s = session.session_for(env)
        with torch.no_grad():
            s.model.load_weights(iter(handed.items()))
        return sorted(name for name, t in handed.items() if not torch.equal(t, weights[name]))


@dataclass(frozen=True)
class RaiseWhileOthersWait:
    """Rank `bad` raises at once; the others wait `wait_s` outside any collective (as ranks waiting on it
    through a transport the recorder does not see)."""
    bad: int
    wait_s: float

    def __call__(self, ctx):
        import time
        if ctx.rank == self.bad:
            raise ValueError(f"boom on rank {ctx.rank}")
        time.sleep(self.wait_s)
        return 0
