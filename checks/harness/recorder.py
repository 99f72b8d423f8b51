"""Per-rank record of every torch.distributed collective, reported live to the parent.

Installed in each rank process by patching the torch.distributed entry points, so any target that uses
torch.distributed (our spec, SGLang's GroupCoordinator on gloo) is recorded without cooperating.
Each call sends ("enter", record) before and ("exit", seq) after over the rank's pipe: the parent's
wait-for analysis (world.diagnose) needs to know who is blocked where while it is still blocked.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
        "all_to_all_single", "all_to_all", "broadcast", "barrier", "reduce", "gather", "scatter")


@dataclass(frozen=True)
class Record:
    seq: int             # per-rank call number within the example
    op: str
    group: tuple[int, ...]
    group_name: str      # every role the group plays in the layout ("tp/moe_ep"): one object can be several
    gseq: int            # call number on this group within the example (matches across members)
    shapes: tuple
    dtype: str
    site: str

    def signature(self) -> tuple:
        return (self.op, self.group, self.shapes, self.dtype)

    def short(self) -> str:
        return (f"#{self.gseq} {self.op} on {self.group_name}{list(self.group)} "
                f"shapes={list(self.shapes)} {self.dtype} at {self.site}")


class Recorder:
    def __init__(self, send):
        self._send = send
        self.names: dict[int, list[str]] = {}     # id(process group) -> its roles in the current layout
        self.reset()

    def reset(self):
        self.records: list[Record] = []
        self._gseq: dict[tuple[int, ...], int] = {}
        self.seconds = 0.0     # host wall time inside collectives this example (waits for slower ranks included)

    def name_group(self, pg, name: str):
        """Add `name` to the roles of `pg`. When two roles of a layout have the same ranks (tp and moe_ep in
        tp4-dp4-ep4, tp and moe_tp in tp4-dp2-ep1) they are one process group, so a call on it is a call in
        every one of those roles: the record names them all rather than whichever was named last."""
        roles = self.names.setdefault(id(pg), [])
        if name not in roles:
            roles.append(name)

    def forget_roles(self):
        """A new layout names its groups afresh (a world's groups are reused across layouts)."""
        self.names.clear()

    def _group_ranks(self, group) -> tuple[int, ...]:
        if group is None or group is dist.group.WORLD:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))

    def _describe(self, op, args, kwargs):
        group = kwargs.get("group")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors) + tuple(tuple(t.shape) for l in lists for t in l)
        dtype = str((tensors or [t for l in lists for t in l] or [torch.empty(0)])[0].dtype).replace("torch.", "")
        if op in ("all_to_all_single",):
            splits = (kwargs.get("output_split_sizes"), kwargs.get("input_split_sizes"))
            shapes = shapes + (tuple(tuple(s) if s else () for s in splits),)
        ranks = self._group_ranks(group)
        pg = dist.group.WORLD if group is None else group
        name = "/".join(self.names.get(id(pg), ())) or ("world" if group is None else "group")
        return ranks, name, shapes, dtype

    def wrap(self, op, fn):
        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if "group" not in kwargs:
                # positional group argument: torch's signatures put it after the tensors / op
                import inspect
                try:
                    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
                    if "group" in bound.arguments:
                        kwargs = dict(bound.arguments)
                        args = ()
                except TypeError:
                    pass
            ranks, name, shapes, dtype = self._describe(op, args, kwargs)
            gseq = self._gseq.get(ranks, 0) + 1
            self._gseq[ranks] = gseq
            rec = Record(len(self.records) + 1, op, ranks, name, gseq, shapes, dtype, _call_site())
            self.records.append(rec)
            self._send(("enter", rec))
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self._send(("exit", rec.seq))
            return out
        return recorded

    def install(self):
        global _ACTIVE
        _ACTIVE = self
        for op in _OPS:
            fn = getattr(dist, op, None)
            if fn is not None and not getattr(fn, "_dpep_recorded", False):
                w = self.wrap(op, fn)
                w._dpep_recorded = True
                setattr(dist, op, w)
                # modules that did `from torch.distributed import all_reduce` before install keep the original;
                # the distributed_c10d module is where torch itself looks them up.
                if hasattr(dist.distributed_c10d, op):
                    setattr(dist.distributed_c10d, op, w)


_ACTIVE: Recorder | None = None      # this rank's recorder, once installed


@contextmanager
def setup_phase(what: str):
    """Mark a rank's set-up (imports, a model build, an engine's parallel state): the parent times it against
    the world's set-up deadline instead of the example's collective deadline (checks.harness.world, World.run). Outside
    a world's rank (no recorder installed) it does nothing. Phases do not nest: an inner one is part of the
    outer."""
    rec = _ACTIVE
    if rec is None or getattr(rec, "_in_setup", False):
        yield
        return
    rec._in_setup = True
    rec._send(("setup", what))
    try:
        yield
    finally:
        rec._in_setup = False
        rec._send(("setup", None))


_SKIP = (os.sep + "torch" + os.sep, "recorder.py", "functools.py")


def _call_site() -> str:
    f = sys._getframe(2)
    while f is not None and any(s in f.f_code.co_filename for s in _SKIP):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"


def mismatches(records: dict[int, list[Record]]) -> list[str]:
    """Collective discipline: every member of a group issues the same calls on it, in the same order,
    with the same op, shapes and dtype. Returns one line per broken group (first differing call)."""
    by_group: dict[tuple[int, ...], dict[int, list[Record]]] = {}
    for rank, recs in records.items():
        for rec in recs:
            by_group.setdefault(rec.group, {}).setdefault(rank, []).append(rec)
    problems = []
    for group, per_rank in by_group.items():
        seqs = {m: [x.signature() for x in per_rank.get(m, [])] for m in group if m in records}
        base = min(seqs, key=lambda m: (-len(seqs[m]), m))
        for m, s in sorted(seqs.items()):
            if s == seqs[base]:
                continue
            n = next((k for k, (a, b) in enumerate(zip(s, seqs[base])) if a != b), min(len(s), len(seqs[base])))
            mine = per_rank.get(m, [])
            a = mine[n].short() if n < len(mine) else "nothing (skipped it)"
            b = per_rank[base][n].short()
            problems.append(f"group {list(group)}, call #{n + 1}: rank {m} issued {a}; rank {base} issued {b}")
    return problems
