"""Invariance mutants: the batch-invariant spec (checks.catalog.variants.BatchInvariant, which promises batch and
placement invariance everywhere, layout invariance where its sums cannot depend on the layout) with one change that keeps every output inside the tolerance model (the parity
properties pass it: a sum split or reordered moves a float32 result by an ulp or so) but breaks a promise.
Each is killed by the invariance property it names (property_tests/test_invariance.py; the kill test is
checks/tests/test_invariance.py). Select one with `--target checks.catalog.invariance_mutants:I01`.

These are the mechanisms the public trackers report: a GEMM whose split-K or blocking is chosen from the
number of rows (SGLang's and vLLM's batch-invariant modes exist to pin it), a fused MoE that orders its
experts by load, a reduction keyed to the rank that runs it.
"""
from __future__ import annotations

import torch

from dpep_parity.checks.catalog.mutants import Mutant
from dpep_parity.checks.catalog.variants import BatchInvariant
from dpep_parity.checks.targets.spec import SpecTarget, linear
from dpep_parity.registry import Registry

# this module's invariance mutants, and outside packages' (entry points of group dpep_parity.invariance_mutants)
CATALOG: Registry[Mutant] = Registry("invariance_mutants", accept=Mutant, names=lambda m: (m.id,),
                                     noun="invariance mutant")


def mutant(id: str, name: str, mechanism: str, kills: tuple[str, ...]):
    def register(cls):
        CATALOG.register(Mutant(id, name, "bits change with the batch or the placement", mechanism, cls, kills))
        return cls
    return register


def split_k(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T as two half-K GEMMs added (a split-K kernel): the same value up to an ulp, other bits."""
    h = x.shape[-1] // 2
    y = linear(x[..., :h], w[:, :h]) + linear(x[..., h:], w[:, h:])
    return y if b is None else y + b


def _split_rows(x, w, b=None):
    """Row by row (batch-invariant) but split-K."""
    if not x.shape[0]:
        return linear(x, w, b)
    return torch.cat([split_k(x[r: r + 1], w, b) for r in range(x.shape[0])])


@mutant("I01", "split-k-by-batch-size",
        "a GEMM splits K once it is given more than one row (kernel choice by M)", kills=("batch", "placement"))
class SplitKByBatchSize(BatchInvariant):
    def linear(self, x, w, b=None):
        if x.shape[0] <= 1:
            return linear(x, w, b)
        return _split_rows(x, w, b)


@mutant("I02", "expert-sum-by-token-count",
        "a row's expert outputs added in the order of the experts' token counts in the whole batch",
        kills=("batch", "placement"))
class ExpertSumByTokenCount(BatchInvariant):
    def mlp(self, i, x, n_real, counts):
        self._load = None
        if self.is_sparse(i) and x.shape[0]:
            _, ids = self.route(i, x[:n_real])
            self._load = torch.bincount(ids.reshape(-1), minlength=self.cfg["num_experts"]).tolist()
        try:
            return super().mlp(i, x, n_real, counts)
        finally:
            self._load = None

    def local_experts(self):
        local = super().local_experts()
        load = getattr(self, "_load", None)
        return local if load is None else sorted(local, key=lambda e: (-load[e], e))


class _SplitKWhile(BatchInvariant):
    """BatchInvariant whose GEMMs split K (row by row) while a mutant's trigger holds during one of its steps."""
    _split_k = False

    def _split_k_during(self, on: bool, step, *args):
        self._split_k = on
        try:
            return step(*args)
        finally:
            self._split_k = False

    def linear(self, x, w, b=None):
        return _split_rows(x, w, b) if self._split_k else super().linear(x, w, b)


@mutant("I03", "reduction-order-by-dp-rank",
        "the attention's projections split K on odd DP ranks (a reduction keyed to the rank that runs it)",
        kills=("placement",))
class ReductionOrderByDpRank(_SplitKWhile):
    def attention(self, i, step, xs):
        return self._split_k_during(self.dp_rank % 2 == 1, super().attention, i, step, xs)


@mutant("I04", "gemm-blocking-by-padding",
        "the MLP's GEMMs split K when the MAX_LEN buffer holds more than one row per DP rank (blocking chosen "
        "from the padded size)", kills=("placement", "batch"))
class GemmBlockingByPadding(_SplitKWhile):
    def mlp_padded(self, i, buf, step, counts):
        return self._split_k_during(buf.shape[0] > self.lay.dp, super().mlp_padded, i, buf, step, counts)


@mutant("I05", "gemm-blocking-by-layout",
        "every GEMM splits K once experts are spread over EP ranks (a kernel chosen by the layout)", kills=("layout",))
class GemmBlockingByLayout(BatchInvariant):
    def linear(self, x, w, b=None):
        if self.lay.ep > 1:
            return _split_rows(x, w, b)
        return super().linear(x, w, b)


def _target(m: Mutant) -> SpecTarget:
    from dpep_parity.checks.catalog.variants import BATCH_INVARIANT
    t = SpecTarget()
    t.model_class, t.name = m.model, f"spec~batch-invariant~{m.id}"
    t.invariances, t.invariant_layouts = BATCH_INVARIANT.invariances, BATCH_INVARIANT.invariant_layouts
    return t


_TARGETS: dict[str, SpecTarget] = {}


def __getattr__(id: str) -> SpecTarget:
    """`checks.catalog.invariance_mutants:I01`: the batch-invariant spec with mutant I01, built once."""
    if id not in _TARGETS:
        if id.startswith("__") or id not in CATALOG:
            raise AttributeError(f"module {__name__!r} has no attribute {id!r}")
        _TARGETS[id] = _target(CATALOG[id])
    return _TARGETS[id]
