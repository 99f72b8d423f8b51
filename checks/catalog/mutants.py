"""The bug catalog (shared BUGS.md) as code: each mutant is the spec target with one small, named change
that reproduces a real bug's mechanism. Select one as a target with `--target checks.catalog.mutants:B14`.

The suite must fail on every mutant (python -m checks.tools.killtable prints who caught what) and pass on the
unmutated spec. Entries no layer-level run of this spec can express are in NOT_EXPRESSED with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpep_parity.checks.core.batches import MAX_LEN, SUM_LEN, ceil_align
from dpep_parity.checks.targets.spec import SpecModel, SpecTarget, linear, rms_norm
from dpep_parity.registry import Registry


@dataclass(frozen=True)
class Mutant:
    id: str
    name: str
    kind: str          # what a user sees: wrong numbers, hang, crash
    mechanism: str
    model: type
    kills: tuple[str, ...]        # the properties (checks.judge.parity.Check.prop) that should catch it: the kill
                                  # table flags a kill by any other as unexplained


# the catalog: this module's mutants, and outside packages' (entry points of group dpep_parity.mutants, each a
# Mutant whose model is a SpecModel subclass); `--target checks.catalog.mutants:ID` selects any of them
CATALOG: Registry[Mutant] = Registry("mutants", accept=Mutant, names=lambda m: (m.id,))


def mutant(id: str, name: str, kind: str, mechanism: str, kills: tuple[str, ...]):
    def register(cls):
        CATALOG.register(Mutant(id, name, kind, mechanism, cls, kills))
        return cls
    return register


@mutant("B01", "attention-over-full-tp", "crash",
        "attention sharded and all-reduced over the whole TP group while DP ranks hold different batches",
        kills=("parity", "ownership", "no-crash"))
class AttentionOverFullTP(SpecModel):
    def attention(self, i, step, xs):
        lay, r = self.lay, self.attn_tp_rank
        self.lay = type(lay)(lay.tp, 1, lay.ep)          # pretend there is no DP attention
        self.attn_tp_rank = self.rank
        try:
            out = super().attention(i, step, xs)
        finally:
            self.lay, self.attn_tp_rank = lay, r
        dist.all_reduce(out, group=self.g.tp)
        return out


@mutant("B02", "idle-rank-skips-gather", "hang", "a rank with zero tokens skips the DP gather the others enter",
        kills=("liveness",))
class IdleSkipsGather(SpecModel):
    def gather(self, local, step, mode, partial):
        if step.num_tokens == 0:
            counts = step.batch.tokens_per_dp()
            n = sum(counts) if mode == SUM_LEN else self.max_len(counts) * self.lay.dp
            return torch.zeros(n, self.H, dtype=local.dtype, device=local.device)
        return super().gather(local, step, mode, partial)


@mutant("B03", "wrong-attn-tp-rank", "wrong numbers",
        "attention-TP rank taken as rank // dp instead of the global map rank % attn_tp: heads duplicated",
        kills=("parity", "routing"))
class WrongAttnTPRank(SpecModel):
    def __init__(self, env):
        super().__init__(env)
        self.attn_tp_rank = (self.rank // self.lay.dp) % self.lay.attn_tp


@mutant("B04", "unaligned-max-len", "crash",
        "MAX_LEN slot not aligned to attention TP before the reduce-scatter",
        kills=("no-crash", "liveness"))
class UnalignedMaxLen(SpecModel):
    def max_len(self, counts):
        return max(counts)


@mutant("B06", "local-dp-offset", "wrong numbers",
        "gather/scatter offsets computed from the rank inside its group instead of the global DP rank",
        kills=("ownership", "parity"))
class LocalDpOffset(SpecModel):
    def dp_offset(self, counts):
        return sum(counts[: self.attn_tp_rank % len(counts)])


@mutant("B07", "lm-head-group-mismatch", "wrong logits / shape crash",
        "dp-lm-head: vocab sharded over the attention-TP group but logits gathered over the TP group",
        kills=("liveness", "ownership", "no-crash"))
class LmHeadGroupMismatch(SpecModel):
    def vocab_parallel(self, h, parts, idx, group):
        if self.lay.dp_lm_head:
            group, parts = self.g.tp, self.lay.tp
        return super().vocab_parallel(h, parts, idx, group)


@mutant("B08", "reduce-only-with-shared-expert", "wrong numbers",
        "the MoE all-reduce nested under 'if shared expert': routed partials never reduced without one",
        kills=("parity",))
class ReduceOnlyWithShared(SpecModel):
    def _has_shared(self):
        return bool(self.cfg.get("shared_expert_intermediate_size"))

    def mlp_all_reduce(self, i, y):
        return super().mlp_all_reduce(i, y) if self._has_shared() or not self.is_sparse(i) else y

    def reduce_and_scatter(self, y, step, mode):
        if self._has_shared():
            return super().reduce_and_scatter(y, step, mode)
        off, n = self.slot(step, mode)
        return y[off: off + n].clone()


@mutant("B09", "every-layer-sparse", "silent garbage",
        "decoder_sparse_step / mlp_only_layers ignored: dense layers' MLP weights silently dropped",
        kills=("parity",))
class EveryLayerSparse(SpecModel):
    def mlp(self, i, x, n_real, counts):
        if not self.is_sparse(i):
            return torch.zeros_like(x)   # no expert weights exist for this layer: nothing is computed
        return super().mlp(i, x, n_real, counts)


@mutant("B10", "shared-reads-overwritten-input", "wrong numbers",
        "the shared expert reads its input after the in-place routed MoE overwrote it",
        kills=("parity",))
class SharedReadsOverwritten(SpecModel):
    def moe(self, i, x, n_real, counts):
        w, ids = self.route(i, x)
        out = self.routed_experts(i, x, w, self.mask_padding(ids, n_real), counts)
        x = x.clone().copy_(out)         # the fused kernel wrote its output over the input buffer
        return self.combine(out, self.shared_expert(i, x))


@mutant("B11", "padded-rows-dispatched", "polluted expert stats",
        "MAX_LEN padding rows dispatched to experts (num_token_non_padded missing)",
        kills=("dispatch",))
class PaddedRowsDispatched(SpecModel):
    def mask_padding(self, ids, n_real):
        return ids


@mutant("B12", "max-len-during-extend", "accuracy drop",
        "padding mode chosen by cost alone: MAX_LEN padding while ranks extend",
        kills=("padding-rule",))
class MaxLenDuringExtend(SpecModel):
    def padding_mode(self, step):
        counts = step.batch.tokens_per_dp()
        if step.batch.nobody_runs:
            return None
        return MAX_LEN if sum(counts) * 2 >= max(counts) * step.batch.dp else SUM_LEN


@mutant("B13", "scatter-into-shared-local-buffer", "wrong numbers",
        "dp_scatter writes into one persistent local buffer that the next scatter overwrites (aliasing)",
        kills=("parity",))
class ScatterIntoSharedBuffer(SpecModel):
    def scatter(self, buf, step, mode):
        off, n = self.slot(step, mode)
        local = self._cache.get("local_buf")
        if local is None or local.shape[0] < n or local.dtype != buf.dtype:
            local = self._cache["local_buf"] = torch.empty(max(n, 1), self.H, dtype=buf.dtype, device=buf.device)
        out = local[:n]
        out.copy_(buf[off: off + n])
        return out


@mutant("B14", "double-reduction", "wrong numbers, fluent text",
        "the model all-reduces the MoE output and the communicator reduce-scatters it again (x tp)",
        kills=("parity",))
class DoubleReduction(SpecModel):
    def reduce_and_scatter(self, y, step, mode):
        dist.all_reduce(y, group=self.g.tp)     # the model's own all-reduce of the MoE output ...
        return super().reduce_and_scatter(y, step, mode)   # ... then the communicator's reduction


@mutant("B15", "replicated-shared-expert-summed", "wrong numbers",
        "a replicated (unsharded) shared expert summed by the post-MoE all-reduce: routed + tp * shared",
        kills=("parity",))
class ReplicatedSharedSummed(SpecModel):
    def shared_expert_shard(self):
        return 1, 0      # every rank computes the whole shared expert; the all-reduce then sums tp copies


@mutant("B16", "idle-logits-index", "crash",
        "an idle rank padded to an EXTEND of length 0: logits index cumsum([0]) - 1 = -1 returns a row",
        kills=("ownership", "no-crash"))
class IdleLogitsIndex(SpecModel):
    def lm_head(self, h, step):
        if self.lay.dp_lm_head and step.num_tokens == 0:
            h = torch.zeros(1, self.H, dtype=h.dtype, device=h.device)[torch.tensor([0]).cumsum(0) - 1]
        return super().lm_head(h, step)


@mutant("B18", "embedding-sharded-attn-tp", "hang",
        "embedding vocab-sharded over the attention-TP group under DP attention, reduced over TP",
        kills=("liveness",))
class EmbeddingShardedAttnTP(SpecModel):
    def embed(self, ids):
        if self.lay.dp == 1:
            return super().embed(ids)
        w = self.W("model.embed_tokens.weight")
        s = self.shard(w.shape[0], self.lay.attn_tp, self.attn_tp_rank)
        local = ids - s.start
        inside = (local >= 0) & (local < s.stop - s.start)
        out = F.embedding(torch.where(inside, local, 0), w[s]) * inside[:, None].to(w.dtype)
        dist.all_reduce(out, group=self.g.tp)
        return out


@mutant("B20", "padding-from-local-count", "hang",
        "MAX_LEN padding size chosen from this rank's unpadded count: ranks run different shapes",
        kills=("liveness", "no-crash"))
class PaddingFromLocalCount(SpecModel):
    def max_len(self, counts):
        return ceil_align(max(counts[self.dp_rank], 1), self.lay.attn_tp)


# ---- mutants of the model semantics ----
@mutant("M01", "norm-topk-prob-ignored", "wrong numbers", "norm_topk_prob ignored: top-k weights not renormalised",
        kills=("parity", "router"))
class NormTopkIgnored(SpecModel):
    def topk_weights(self, w):
        return w


@mutant("M02", "shared-gate-without-sigmoid", "wrong numbers", "shared-expert gate applied without the sigmoid",
        kills=("parity",))
class SharedGateNoSigmoid(SpecModel):
    def shared_gate(self, i, x):
        return linear(x, self.W(f"model.layers.{i}.mlp.shared_expert_gate.weight"))


@mutant("M03", "qk-norm-after-rope", "wrong numbers", "Qwen3 qk-norm applied after RoPE instead of before",
        kills=("parity",))
class QkNormAfterRope(SpecModel):
    def qk_norm_and_rope(self, i, q, k, pos):
        q, k = self.rope(q, pos), self.rope(k, pos)
        if self.qk_norm:
            p = f"model.layers.{i}.self_attn."
            q = rms_norm(q, self.W(p + "q_norm.weight"), self.eps)
            k = rms_norm(k, self.W(p + "k_norm.weight"), self.eps)
        return q, k


@mutant("M04", "strided-expert-ownership", "wrong numbers",
        "tokens dispatched by a strided expert map while the weights were loaded as contiguous blocks",
        kills=("parity",))
class StridedExpertOwnership(SpecModel):
    def routed_experts(self, i, x, w, ids, counts):
        per = self.E // self.lay.ep
        remap = torch.full((self.E + 1,), -1, dtype=ids.dtype)
        for j in range(per):   # expert (ep_rank + j*ep) is computed with the weights of expert (block + j)
            remap[self.ep_rank + j * self.lay.ep] = self.ep_rank * per + j
        ids = torch.where(ids >= 0, remap[ids.clamp(min=0)], ids)
        return super().routed_experts(i, x, w, ids, counts)


@mutant("M05", "kv-heads-not-replicated", "wrong numbers",
        "fewer KV heads than attention-TP ranks: KV head picked as rank % kv instead of replicated blocks",
        kills=("parity",))
class KvNotReplicated(SpecModel):
    def kv_head_range(self):
        if self.kv >= self.lay.attn_tp:
            return super().kv_head_range()
        h = self.attn_tp_rank % self.kv
        return range(h, h + 1)


@mutant("M06", "residual-on-every-attn-tp-rank", "wrong numbers",
        "the residual folded in on every attention-TP rank before the partial gather (x attn_tp)",
        kills=("parity", "routing"))
class ResidualEveryRank(SpecModel):
    def folds_residual(self):
        return True


@mutant("M07", "max-len-slot-skips-idle-ranks", "wrong numbers, decode only",
        "under MAX_LEN padding a DP rank finds its slot by counting only the DP ranks holding tokens before it: "
        "after an idle rank it reads another rank's rows. MAX_LEN is chosen only when no rank extends, so only "
        "decode steps with an idle DP rank go wrong: a prefill-only engine never shows it",
        kills=("parity", "routing", "greedy"))
class MaxLenSlotSkipsIdle(SpecModel):
    def slot(self, step, mode):
        if mode == SUM_LEN:
            return super().slot(step, mode)
        counts = step.batch.tokens_per_dp()
        busy_before = sum(1 for c in counts[: self.dp_rank] if c)
        return busy_before * self.max_len(counts), counts[self.dp_rank]


@mutant("M08", "idle-decode-double-reduce", "wrong numbers, decode only",
        "a fix for the idle-rank hang (B02) that re-issues the MoE reduction in MAX_LEN steps with an idle DP "
        "rank, so every rank enters the same collectives, reduces the busy ranks' MoE output twice; MAX_LEN "
        "is chosen only when no rank extends, so only decode steps with an idle DP rank go wrong: a "
        "prefill-only engine never shows it",
        kills=("parity", "routing"))
class IdleDecodeDoubleReduce(SpecModel):
    def reduce_and_scatter(self, y, step, mode):
        if mode != SUM_LEN and 0 in step.batch.tokens_per_dp():
            dist.all_reduce(y, group=self.g.tp)
        return super().reduce_and_scatter(y, step, mode)


@mutant("M09", "dp-offsets-captured-per-batch-size", "wrong numbers when the same work is spread differently",
        "the DP gather / scatter offsets captured once per total token count and replayed, as metadata captured "
        "with a CUDA graph per batch-size bucket: a later batch of the same size spread differently over the DP "
        "ranks reads its rows from the first one's offsets (wrong rows, or a slice past the end: a crash); one "
        "forward alone is right, so it shows only in a sequence of forwards on one build: the stateful "
        "property's rebalance step, or the model unit's priming forward and step when their sizes collide",
        kills=("parity", "ownership", "routing", "dispatch", "no-crash"))
class OffsetsCapturedPerSize(SpecModel):
    def dp_offset(self, counts):
        captured = self._cache.setdefault("captured_offsets", {})
        return captured.setdefault(sum(counts), super().dp_offset(counts))


@mutant("M10", "gathered-buffer-assumed-zero", "wrong numbers when fresh memory is not zero",
        "the SUM_LEN gather (an all-reduce of a buffer where each DP rank writes its rows) clears the persistent "
        "buffer only when it reuses it, trusting a freshly allocated one to be zero; whether it fails depends on "
        "what the allocator returns (on this CPU the pinned examples see garbage), poisoned allocations (the "
        "stateful property's debug mode) make it fail every time, on any allocator",
        kills=("parity", "routing", "dispatch"))
class BufferAssumedZero(SpecModel):
    def cleared_buffer(self, rows, like):
        before = self._cache.get("global_buf")
        buf = self.global_buffer(rows, like)
        return buf.zero_() if self._cache.get("global_buf") is before else buf   # fresh: "already zero"


# ---- precision faults: an intermediate kept in the activation dtype where the reference keeps float32 ----
# Each is exactly the spec in a float32 run; in bfloat16 its error has the size of legitimate rounding
# differences, so the per-row bound cannot see it: the precision property pools the evidence
# (property_tests/test_precision.py, checks/core/numerics.py "precision"). docs/precision.md has the measurements.
@mutant("P01", "norm-statistics-in-activation-dtype", "precision",
        "every RMSNorm's mean of squares, reciprocal root and scaling computed in the activation dtype instead of "
        "float32: one rounded scale per row, a coherent error (pytorch/pytorch#189581, amd/IRON#139)",
        kills=("precision",))
class NormInActivationDtype(SpecModel):
    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@mutant("P04", "rope-angles-in-activation-dtype", "precision",
        "RoPE's position x inverse-frequency product formed in the activation dtype: bfloat16 holds integers "
        "exactly only up to 256, so past a few dozen positions the angles are off by up to a radian "
        "(EleutherAI/gpt-neox#1003, huggingface/transformers#29285, sgl-project/sglang-jax#1473); only long "
        "positions show it, which the precision property draws (at 64-200 positions one row's error passes the "
        "per-row bound, [parity], where it does not already tip the pooled test)",
        kills=("parity", "precision"))
class RopeAnglesInActivationDtype(SpecModel):
    def rope_angles(self, pos, dtype):
        return (pos[:, None].to(dtype) * self.inv_freq[None].to(dtype)).float()


@mutant("P02", "router-softmax-in-activation-dtype", "precision",
        "the router's softmax in the activation dtype: the probabilities are rounded to it before the top-k and "
        "the renormalisation then runs in it too (probabilities, their sum, the quotient: three roundings where "
        "a float32 router has one). The block output dilutes a one-ulp weight error below the legitimate "
        "variants' spread; the router-weights check judges the weights themselves (bfloat16, models with "
        "norm_topk_prob: without renormalisation the one rounding is the correct router's own)",
        kills=("router",))
class RouterSoftmaxInActivationDtype(SpecModel):
    def router_probs(self, logits):
        return torch.softmax(logits.to(self.dt), dim=-1)


@mutant("P05", "topk-renormalisation-in-activation-dtype", "precision",
        "the top-k renormalisation in the activation dtype: the float32 probabilities are rounded to it, then "
        "summed and divided in it (vLLM and SGLang kernels that renormalise after the cast); caught by the "
        "router-weights check in bfloat16 on models with norm_topk_prob",
        kills=("router",))
class RenormInActivationDtype(SpecModel):
    def topk_weights(self, w):
        if not self.cfg.get("norm_topk_prob"):
            return w
        w = w.to(self.dt)
        return w / w.sum(-1, keepdim=True)


NOT_EXPRESSED = {
    "B05": "needs moe_dense_tp_size = 1 (a replicated dense MLP on local tokens); the spec only implements "
           "the TP-sharded dense path",
    "B17": "needs an all-to-all MoE backend where each rank routes only its own tokens; the spec's MoE always "
           "runs on the gathered buffer, which is empty only when nobody runs",
    "B19": "sequence-parallel MoE is not part of SGLang's Qwen2/Qwen3-MoE path that the spec mirrors",
    # precision habits measured as no fault at all against this reference (docs/precision.md): the reference
    # rounds the same quantity to the activation dtype right after, so keeping it narrow earlier changes
    # nothing or adds one double rounding, far below any legitimate reordering's effect
    "P03": "attention softmax in the activation dtype: bit-identical to the spec on CPU (torch's CPU bfloat16 "
           "softmax accumulates in float32 and rounds once; transformers rounds the probabilities to the dtype "
           "right after anyway)",
}


class MutantTarget(SpecTarget):
    def __init__(self, m: Mutant):
        self.mutant, self.model_class, self.name = m, m.model, f"spec~{m.id}"
        self.expected_kills = m.kills      # read by checks.tools.killtable (outside targets may declare it too)


_TARGETS: dict[str, MutantTarget] = {}


def __getattr__(id: str) -> MutantTarget:
    """`checks.catalog.mutants:B14`: the spec target with mutant B14, for every mutant in the catalog (an outside
    package's too), built once."""
    if id not in _TARGETS:
        if id.startswith("__") or id not in CATALOG:
            raise AttributeError(f"module {__name__!r} has no attribute {id!r}")
        _TARGETS[id] = MutantTarget(CATALOG[id])
    return _TARGETS[id]
