"""Legitimate variants of the spec target: other correct ways to compute the same layers, rounding differently
in half precision. The tolerance model (its max-error bound, bias test and precision test) must pass them:
they are the positive controls of the precision test (checks/tests/test_precision.py), as the precision
mutants of checks.mutants (P01, P04) are its negative controls. Select one with
`--target checks.variants:EXPERTS_REVERSED` and so on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dpep_parity.checks.batches import SUM_LEN
from dpep_parity.checks.targets.spec import SpecModel, SpecTarget


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
        n = dist.get_world_size(group)
        if n == 1:
            return
        flat = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(flat, t.contiguous(), group=group)   # gloo wants the concatenated shape
        parts = flat.view(n, *t.shape)
        acc = parts[n - 1].clone()
        for k in range(n - 2, -1, -1):
            acc = acc + parts[k]
        t.copy_(acc)


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


def _target(cls, name):
    t = SpecTarget()
    t.model_class, t.name = cls, f"spec~{name}"
    return t


EXPERTS_LOOP = _target(ExpertsLoop, "experts-loop")
EXPERTS_GROUPED = _target(ExpertsGrouped, "experts-grouped")
EXPERTS_REVERSED = _target(ExpertsReversed, "experts-reversed")
EXPERTS_FP32_ACCUMULATE = _target(ExpertsFp32Accumulate, "experts-fp32-accumulate")
ALL_REDUCE_BY_GATHER = _target(AllReduceByGather, "all-reduce-by-gather")
REDUCE_SCATTER_BY_ALL_REDUCE = _target(ReduceScatterByAllReduce, "reduce-scatter-by-all-reduce")
VARIANTS = {"EXPERTS_LOOP": EXPERTS_LOOP, "EXPERTS_GROUPED": EXPERTS_GROUPED, "EXPERTS_REVERSED": EXPERTS_REVERSED, "EXPERTS_FP32_ACCUMULATE": EXPERTS_FP32_ACCUMULATE,
            "ALL_REDUCE_BY_GATHER": ALL_REDUCE_BY_GATHER, "REDUCE_SCATTER_BY_ALL_REDUCE": REDUCE_SCATTER_BY_ALL_REDUCE}
