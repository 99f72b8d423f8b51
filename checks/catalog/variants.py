"""Legitimate variants of the spec target: other correct ways to compute the same layers, rounding differently
in half precision. The tolerance model (its max-error bound, bias test and precision test) must pass them:
they are the positive controls of the precision test (checks/tests/test_precision.py), as the precision
mutants of checks.catalog.mutants (P01, P04) are its negative controls. Select one with
`--target checks.catalog.variants:EXPERTS_REVERSED` and so on.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from dpep_parity.checks.core.batches import SUM_LEN
from dpep_parity.checks.targets.protocol import Route
from dpep_parity.checks.targets.spec import SpecModel, SpecTarget, linear


class ExpertsLoop(SpecModel):
    """The routed experts as a per-expert loop of GEMMs, each expert's weighted output added in expert order in
    the dtype (transformers' eager experts), where the spec runs a grouped GEMM (bf16 on CUDA). On the CPU
    tier the spec itself runs this loop."""

    def grouped_experts(self, x):
        return False


class ExpertsGrouped(SpecModel):
    """The routed experts as grouped GEMMs wherever torch has them for the dtype (bf16, fp16 and fp32, on CUDA
    and on CPU), where the spec itself takes them only for bf16 on CUDA: the grouped path's positive control
    on the CPU tier, and its fp32 counterpart on the GPU."""

    def grouped_experts(self, x):
        from dpep_parity.checks.targets.spec import _grouped_mm
        return _grouped_mm() is not None and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


class ExpertsReversed(ExpertsLoop):
    """The local experts' outputs added in the opposite order (another index_add order in the dtype)."""

    def local_experts(self):
        return range(super().local_experts().stop - 1, super().local_experts().start - 1, -1)


class ExpertsFp32Accumulate(ExpertsLoop):
    """Expert outputs accumulated in float32 and rounded once (fused MoE kernels' habit)."""
    expert_accumulator_dtype = torch.float32


class AllReduceByGather(SpecModel):
    """Every all-reduce as an all-gather of the ranks' tensors and a local sum in reversed rank order."""

    def all_reduce(self, t, group):
        gathered_sum(t, group, reverse=True)


class ReduceScatterByAllReduce(SpecModel):
    """MAX_LEN's reduce-scatter as an all-reduce of the whole buffer and a slice of this rank's piece."""

    def reduce_and_scatter(self, y, step, mode):
        if mode == SUM_LEN:
            return super().reduce_and_scatter(y, step, mode)
        L = self.max_len(step.batch.tokens_per_dp())
        self.all_reduce(y, self.g.tp)
        piece = L // self.lay.attn_tp
        start = dist.get_rank(group=self.g.tp) * piece      # reduce_scatter_tensor's piece of this rank
        piece_t = y[start: start + piece]
        if self.lay.attn_tp > 1:
            full = torch.empty(L, self.H, dtype=y.dtype, device=y.device)
            dist.all_gather_into_tensor(full, piece_t.contiguous(), group=self.g.attn_tp)
            piece_t = full
        return piece_t[: step.num_tokens].clone()


def gathered_sum(t: torch.Tensor, group, reverse: bool = False) -> None:
    """In place: the group's sum of `t`, gathered and added in rank order ((t0 + t1) + t2) + ... (reversed:
    from the last rank down), whatever the size of the tensor (a collective's own sum order may follow its
    chunking, which follows the size)."""
    n = dist.get_world_size(group)
    if n == 1:
        return
    flat = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(flat, t.contiguous(), group=group)   # gloo wants the concatenated shape
    parts = flat.view(n, *t.shape)
    order = range(n - 1, -1, -1) if reverse else range(n)
    acc = parts[order[0]].clone()
    for k in order[1:]:
        acc = acc + parts[k]
    t.copy_(acc)


class BatchInvariant(ExpertsLoop):
    """The spec with batch-invariant kernels, the positive control of the batch and placement invariance
    properties (checks/judge/invariance.py). Every projection is computed row by row and every MLP / MoE block on one
    row at a time: a GEMM's blocking, and whether a row's elements land in a vectorised body or the scalar tail
    of an elementwise kernel (exp, sigmoid: the two paths round differently), never depend on the other rows
    (what SGLang's and vLLM's batch-invariant modes fix per kernel). Each request's attention runs alone (its
    own rows, no padding to the longest request); every reduction over ranks is added in rank order (gather,
    then a fixed sum), MAX_LEN's reduce-scatters as that sum and a slice. Correct (the parity properties pass
    it) and slower; it promises batch and placement invariance everywhere, layout invariance only where the
    sums cannot depend on the layout (`expert_parallel_layouts`: a TP split changes them)."""

    def linear(self, x, w, b=None):
        if x.shape[0] <= 1:
            return linear(x, w, b)
        return torch.cat([linear(x[r: r + 1], w, b) for r in range(x.shape[0])])

    def norm(self, x, w):
        if x.dim() != 2 or x.shape[0] <= 1:
            return super().norm(x, w)
        return torch.cat([super(BatchInvariant, self).norm(x[r: r + 1], w) for r in range(x.shape[0])])

    def mlp(self, i, x, n_real, counts):
        if x.shape[0] <= 1:
            return super().mlp(i, x, n_real, counts)
        outs, routes = [], []
        for r in range(x.shape[0]):
            self._route = None
            outs.append(super().mlp(i, x[r: r + 1], int(r < n_real), counts))
            routes.append(self._route)
        self._route = None if any(t is None for t in routes) else Route.cat(routes)
        return torch.cat(outs)

    def attention(self, i, step, xs):
        if len(step.requests) <= 1:
            return super().attention(i, step, xs)
        prefix, new, outs = self.kv_prefix, {}, []
        for j, (req, x) in enumerate(zip(step.requests, xs)):
            kept = self.kv_new
            self.kv_prefix = {(i, 0): prefix[(i, j)]} if (i, j) in prefix else {}
            self.kv_new = {}
            outs.append(super().attention(i, replace(step, requests=(req,)), [x]))
            if (i, 0) in self.kv_new:
                new[(i, j)] = self.kv_new[(i, 0)]
            self.kv_new = kept
        self.kv_prefix = prefix
        self.kv_new.update(new)
        return torch.cat(outs)

    def all_reduce(self, t, group):
        gathered_sum(t, group)

    def gather(self, local, step, mode, partial):
        if mode == SUM_LEN or self.lay.attn_tp == 1:
            return super().gather(local, step, mode, partial)
        counts = step.batch.tokens_per_dp()
        L = self.max_len(counts)
        pad = torch.zeros(L, self.H, dtype=local.dtype, device=local.device)
        if partial or self.attn_tp_rank == 0:
            pad[: local.shape[0]] = local
        gathered_sum(pad, self.g.attn_tp)
        piece = L // self.lay.attn_tp
        buf = self.global_buffer(L * self.lay.dp, local)
        mine = pad[self.attn_tp_rank * piece: (self.attn_tp_rank + 1) * piece].contiguous()
        dist.all_gather_into_tensor(buf, mine, group=self.g.tp)
        return buf

    def reduce_and_scatter(self, y, step, mode):
        if mode == SUM_LEN:
            return super().reduce_and_scatter(y, step, mode)
        gathered_sum(y, self.g.tp)
        L = self.max_len(step.batch.tokens_per_dp())
        return y[self.dp_rank * L: self.dp_rank * L + step.num_tokens].clone()


def expert_parallel_layouts(config: dict) -> tuple[tuple[str, ...], ...]:
    """Where BatchInvariant's bits do not depend on the layout either: attention whole on every DP rank and
    experts whole on every EP rank (tp == dp == ep), on a model whose every MLP is a MoE block of top-2 routed
    experts without a shared expert. Each row's output is then c_a + c_b, its two experts' outputs, whichever
    rank holds them (a rank without them adds exact zeros); top-3 would add in an order that follows the
    ranks, a shared or dense MLP would be split over TP."""
    dense = config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
    if config.get("num_experts_per_tok") != 2 or config.get("shared_expert_intermediate_size") or dense:
        return ()
    return (("tp1-dp1-ep1", "tp2-dp2-ep2", "tp4-dp4-ep4"),)


def _target(cls, name, invariances=(), invariant_layouts=()):
    t = SpecTarget()
    t.model_class, t.name = cls, f"spec~{name}"
    if invariances:
        t.invariances = frozenset(invariances)
    if invariant_layouts:
        t.invariant_layouts = invariant_layouts
    return t


EXPERTS_LOOP = _target(ExpertsLoop, "experts-loop")
EXPERTS_GROUPED = _target(ExpertsGrouped, "experts-grouped")
EXPERTS_REVERSED = _target(ExpertsReversed, "experts-reversed")
EXPERTS_FP32_ACCUMULATE = _target(ExpertsFp32Accumulate, "experts-fp32-accumulate")
ALL_REDUCE_BY_GATHER = _target(AllReduceByGather, "all-reduce-by-gather")
REDUCE_SCATTER_BY_ALL_REDUCE = _target(ReduceScatterByAllReduce, "reduce-scatter-by-all-reduce")
BATCH_INVARIANT = _target(BatchInvariant, "batch-invariant", invariances=("batch", "placement", "layout"),
                          invariant_layouts=expert_parallel_layouts)
VARIANTS = {"EXPERTS_LOOP": EXPERTS_LOOP, "EXPERTS_GROUPED": EXPERTS_GROUPED, "EXPERTS_REVERSED": EXPERTS_REVERSED, "EXPERTS_FP32_ACCUMULATE": EXPERTS_FP32_ACCUMULATE,
            "ALL_REDUCE_BY_GATHER": ALL_REDUCE_BY_GATHER, "REDUCE_SCATTER_BY_ALL_REDUCE": REDUCE_SCATTER_BY_ALL_REDUCE,
            "BATCH_INVARIANT": BATCH_INVARIANT}
