"""The `spec` target: SGLang's DP-attention / TP / EP algorithm for Qwen2-MoE / Qwen3-MoE, written with
plain torch.distributed. It is the executable specification the property suite checks, runs on CPU, and
is the body the bug catalog (checks.catalog.mutants) mutates: every step is a small overridable method.

Mirrors (sglang 0.5.x): `layers/dp_attention.py` (_dp_gather_via_all_reduce / _via_all_gather,
dp_scatter, dp_reduce_scatter_tensor, DpPaddingMode), the layer communicator's
`_gather_hidden_states_and_residual` / `_scatter_hidden_states`, `models/qwen2_moe.py` and
`models/qwen3_moe.py` (attention over the attention-TP group, QKVParallelLinear KV replication, the
sigmoid-gated shared expert, the MoE all-reduce), `layers/moe` (EP: contiguous expert blocks, non-local
experts masked; MoE TP: intermediate split), `vocab_parallel_embedding.py` and `logits_processor.py`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from dpep_parity.checks.core.batches import SUM_LEN, ceil_align, padding_mode
from dpep_parity.checks.targets.protocol import UNITS, BuildEnv, Route, Step, to_cpu


def _half_on_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) as a bf16 / fp16 GEMM computes it: products and sums in fp32, one rounding of the output
    to the dtype. On CUDA that is the kernel itself; on CPU, where torch's half-precision GEMMs are 15-30x
    slower than fp32 ones on machines without bf16 units, the same contract is computed in fp32 (a product of
    two bf16 or fp16 values is exact in fp32) and rounded once."""
    if _half_on_cpu(x):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b under the same half-precision GEMM contract as `linear`."""
    if _half_on_cpu(a):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Qwen RMSNorm: statistics in fp32, scale in the input dtype."""
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def _grouped_mm():
    """torch's grouped GEMM (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class SpecModel:
    """The parallel model on one rank. Units use slices of it; mutants override one method each."""

    def __init__(self, env: BuildEnv):
        c = self.cfg = env.config
        self.env, self.lay, self.rank, self.g = env, env.layout, env.rank, env.groups
        self.dt, self.dev = env.dtype, env.device
        self.H = c["hidden_size"]
        self.heads, self.kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        self.hd = c.get("head_dim") or self.H // self.heads
        self.E, self.topk = c.get("num_experts", 0), c.get("num_experts_per_tok", 1)
        self.eps = c["rms_norm_eps"]
        self.qk_norm = c.get("model_type") == "qwen3_moe"
        self.attn_tp_rank, self.dp_rank = self.lay.attn_tp_rank(self.rank), self.lay.dp_rank(self.rank)
        self.moe_tp_rank, self.ep_rank = self.lay.moe_tp_rank(self.rank), self.lay.moe_ep_rank(self.rank)
        self.w = env.weights
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        # computed on the CPU as transformers does, then moved: on CUDA, pos lives on the device
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.inv_freq = inv_freq.to(self.dev)
        self._cache: dict = {}
        self.routes: dict[int, Route] = {}
        self.sessions: dict[str, dict[int, dict]] = {}   # serving: session -> request -> {layer: (k, v)}
        self.kv_prefix: dict[tuple[int, int], tuple] = {}  # (layer, request): cached K/V of the prefix
        self.kv_new: dict[tuple[int, int], tuple] = {}     # (layer, request): K/V after this forward

    # ---------- weights ----------
    def W(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """A (slice of a) checkpoint tensor in the compute dtype, cached."""
        key = (name, rows and (rows.start, rows.stop), cols and (cols.start, cols.stop))
        if key not in self._cache:
            t = self.w[name]
            if rows is not None:
                t = t[rows]
            if cols is not None:
                t = t[:, cols]
            self._cache[key] = t.to(self.dt).to(self.dev).contiguous()
        return self._cache[key]

    def has(self, name: str) -> bool:
        return name in self.w

    @staticmethod
    def shard(n: int, parts: int, idx: int) -> slice:
        per = n // parts
        return slice(idx * per, (idx + 1) * per)

    # ---------- layout rules (mutation points) ----------
    def is_sparse(self, i: int) -> bool:
        """transformers' / sglang's rule (decoder_sparse_step, mlp_only_layers)."""
        c = self.cfg
        return (i not in (c.get("mlp_only_layers") or [])) and self.E > 0 and \
            (i + 1) % (c.get("decoder_sparse_step") or 1) == 0

    def padding_mode(self, step: Step) -> str:
        return padding_mode(step.batch)

    def kv_head_range(self) -> range:
        """QKVParallelLinear: split KV heads over attention TP, or replicate them when there are fewer."""
        a, r = self.lay.attn_tp, self.attn_tp_rank
        if self.kv >= a:
            per = self.kv // a
            return range(r * per, (r + 1) * per)
        return range(r // (a // self.kv), r // (a // self.kv) + 1)

    def local_experts(self) -> range:
        return self.lay.local_experts(self.rank, self.E)

    def dp_offset(self, counts: list[int]) -> int:
        """Start of this DP rank's rows in the SUM_LEN buffer (sglang get_dp_local_info: global DP rank)."""
        return sum(counts[: self.dp_rank])

    def folds_residual(self) -> bool:
        """Only attention-TP rank 0 adds the residual before the partial gather (the sum adds the rest)."""
        return self.attn_tp_rank == 0

    # ---------- attention over the attention-TP group ----------
    def qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor):
        p = f"model.layers.{i}.self_attn."
        qh = self.shard(self.heads, self.lay.attn_tp, self.attn_tp_rank)
        qs = slice(qh.start * self.hd, qh.stop * self.hd)
        kr = self.kv_head_range()
        ks = slice(kr.start * self.hd, kr.stop * self.hd)
        q = self.linear(x, self.W(p + "q_proj.weight", qs), self.W(p + "q_proj.bias", qs) if self.has(p + "q_proj.bias") else None)
        k = self.linear(x, self.W(p + "k_proj.weight", ks), self.W(p + "k_proj.bias", ks) if self.has(p + "k_proj.bias") else None)
        v = self.linear(x, self.W(p + "v_proj.weight", ks), self.W(p + "v_proj.bias", ks) if self.has(p + "v_proj.bias") else None)
        q, k, v = (t.view(t.shape[0], -1, self.hd) for t in (q, k, v))
        q, k = self.qk_norm_and_rope(i, q, k, pos)
        return q, k, v

    def qk_norm_and_rope(self, i, q, k, pos):
        """Qwen3: RMSNorm over head_dim before RoPE."""
        if self.qk_norm:
            p = f"model.layers.{i}.self_attn."
            q = self.norm(q, self.W(p + "q_norm.weight"))
            k = self.norm(k, self.W(p + "k_norm.weight"))
        return self.rope(q, pos), self.rope(k, pos)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """Every projection of the model (`linear`); the batch-invariant variant computes it row by row."""
        return linear(x, w, b)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every RMSNorm of the model (precision mutants override it)."""
        return rms_norm(x, w, self.eps)

    def rope_angles(self, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """RoPE angles position x inverse frequency, in fp32 as transformers computes them."""
        return pos[:, None].float() * self.inv_freq[None]

    def rope(self, x, pos):
        freqs = self.rope_angles(pos, x.dtype)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        return x * cos + rotate_half(x) * sin

    def attention(self, i: int, step: Step, xs: list[torch.Tensor]) -> torch.Tensor:
        """xs: per local request, the normed hidden rows whose K/V are not cached: prefix + extend rows, or
        only the extend rows when the KV cache holds the prefix (self.kv_prefix[(i, j)] = (k, v), as a
        serving session keeps it). Every request's rows are projected at once; each request attends over
        its cached and new K/V; self.kv_new[(i, j)] keeps the request's whole K/V for the next step. Returns
        this rank's o_proj partial [extend rows, hidden] (not reduced: under DP attention the DP gather
        sums it)."""
        starts = [r.prefix if (i, j) in self.kv_prefix else 0 for j, r in enumerate(step.requests)]
        pos = [torch.arange(a, r.total, device=self.dev) for a, r in zip(starts, step.requests)]
        qh = self.shard(self.heads, self.lay.attn_tp, self.attn_tp_rank)
        outs = []
        if xs:
            q, k, v = self.qkv(i, torch.cat(xs), torch.cat(pos))
            sizes = [x.shape[0] for x in xs]
            qs, ks, vs = [], [], []
            for j, (req, qj, kj, vj) in enumerate(zip(step.requests, q.split(sizes), k.split(sizes),
                                                        v.split(sizes))):
                if (i, j) in self.kv_prefix:
                    kp, vp = self.kv_prefix[(i, j)]
                    kj, vj = torch.cat([kp, kj]), torch.cat([vp, vj])
                self.kv_new[(i, j)] = (kj, vj)
                qs.append(qj[qj.shape[0] - req.extend:])
                ks.append(kj)
                vs.append(vj)
            outs = self.attend(qs, ks, vs, [r.prefix for r in step.requests])
        o = torch.cat(outs) if outs else torch.zeros(0, qh.stop - qh.start, self.hd, dtype=self.dt, device=self.dev)
        o = o.reshape(o.shape[0], (qh.stop - qh.start) * self.hd)
        cols = slice(qh.start * self.hd, qh.stop * self.hd)
        return self.linear(o, self.W(f"model.layers.{i}.self_attn.o_proj.weight", cols=cols))

    def attend(self, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor], prefixes: list[int]):
        """Eager causal attention with GQA, as transformers computes it (softmax in fp32), for every request
        at once: queries and keys padded to the longest, padded keys masked like future ones. Per request:
        q [extend, heads, hd] at positions prefix.., k / v [prefix + extend, kv heads, hd]."""
        Q, K, V = (pad_sequence(t, batch_first=True) for t in (qs, ks, vs))
        b, nq, h, d = Q.shape
        nk, kvh = K.shape[1], K.shape[2]
        rep = h // kvh
        # GQA without copying K / V per query head: head g * rep + r attends with KV head g
        Qg = Q.permute(0, 2, 1, 3).reshape(b, kvh, rep * nq, d)
        s = matmul(Qg, K.permute(0, 2, 3, 1)).reshape(b, h, nq, nk) * self.hd ** -0.5   # [b, h, q, k]
        key = torch.arange(nk, device=Q.device)
        qpos = torch.tensor(prefixes, device=Q.device)[:, None] + torch.arange(nq, device=Q.device)[None]
        total = torch.tensor([k.shape[0] for k in ks], device=Q.device)
        mask = (key[None, None] > qpos[:, :, None]) | (key[None, None] >= total[:, None, None])
        s = s.masked_fill(mask[:, None], torch.finfo(s.dtype).min)
        p = self.attention_probs(s).to(Q.dtype)
        out = matmul(p.reshape(b, kvh, rep * nq, nk), V.transpose(1, 2))                # [b, kvh, rep q, d]
        out = out.reshape(b, h, nq, d).transpose(1, 2)                                  # [b, q, h, d]
        return [out[b, : q.shape[0]] for b, q in enumerate(qs)]

    def attention_probs(self, s: torch.Tensor) -> torch.Tensor:
        """Attention softmax, in fp32 as transformers' eager attention computes it."""
        return torch.softmax(s, dim=-1, dtype=torch.float32)

    # ---------- DP gather / scatter ----------
    def gather(self, local: torch.Tensor, step: Step, mode: str, partial: bool) -> torch.Tensor:
        """All DP groups' rows into one buffer on every rank (sglang _dp_gather). `partial`: each
        attention-TP rank holds a partial sum (dp_gather_partial); else only rank 0 writes (replicate)."""
        counts = step.batch.tokens_per_dp()
        if mode == SUM_LEN:
            buf = self.cleared_buffer(sum(counts), local)
            if local.shape[0] and (partial or self.attn_tp_rank == 0):
                off = self.dp_offset(counts)
                buf[off: off + local.shape[0]] = local
            self.all_reduce(buf, self.g.tp)
            return buf
        L = self.max_len(counts)
        pad = torch.zeros(L, self.H, dtype=local.dtype, device=local.device)
        pad[: local.shape[0]] = local
        buf = self.global_buffer(L * self.lay.dp, local)
        if self.lay.attn_tp == 1:
            dist.all_gather_into_tensor(buf, pad, group=self.g.tp)
            return buf
        if not partial and self.attn_tp_rank != 0:
            pad.zero_()
        piece = torch.empty(L // self.lay.attn_tp, self.H, dtype=local.dtype, device=local.device)
        dist.reduce_scatter_tensor(piece, pad, group=self.g.attn_tp)
        dist.all_gather_into_tensor(buf, piece, group=self.g.tp)
        return buf

    def max_len(self, counts: list[int]) -> int:
        """MAX_LEN slot: the largest count, aligned to attention TP for the reduce-scatter (bug B04)."""
        return ceil_align(max(counts), self.lay.attn_tp)

    def global_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """One persistent buffer reused across layers, as sglang's _DpGatheredBufferWrapper (B13)."""
        buf = self._cache.get("global_buf")
        if buf is None or buf.shape[0] < rows or buf.dtype != like.dtype:
            buf = torch.empty(max(rows, 1), self.H, dtype=like.dtype, device=like.device)
            self._cache["global_buf"] = buf
        return buf[:rows]

    def cleared_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """The global buffer zeroed for a gather-by-all-reduce: every rank adds only its own rows (M10)."""
        return self.global_buffer(rows, like).zero_()

    def slot(self, step: Step, mode: str) -> tuple[int, int]:
        counts = step.batch.tokens_per_dp()
        n = counts[self.dp_rank]
        if mode == SUM_LEN:
            return self.dp_offset(counts), n
        return self.dp_rank * self.max_len(counts), n

    def all_reduce(self, t: torch.Tensor, group) -> None:
        """Every in-place sum over a group of the model (legitimate variants reorder it)."""
        dist.all_reduce(t, group=group)

    def scatter(self, buf: torch.Tensor, step: Step, mode: str) -> torch.Tensor:
        """sglang dp_scatter: copy this DP group's rows out of the global buffer (never a view, B13)."""
        off, n = self.slot(step, mode)
        return buf[off: off + n].clone()

    def reduce_and_scatter(self, y: torch.Tensor, step: Step, mode: str) -> torch.Tensor:
        """After the MoE: SUM_LEN all-reduces then scatters; MAX_LEN reduce-scatters over TP and
        all-gathers inside the attention-TP group (sglang dp_reduce_scatter_tensor + communicator)."""
        if mode == SUM_LEN:
            self.all_reduce(y, self.g.tp)
            return self.scatter(y, step, mode)
        L = self.max_len(step.batch.tokens_per_dp())
        piece = torch.empty(L // self.lay.attn_tp, self.H, dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(piece, y.contiguous(), group=self.g.tp)
        if self.lay.attn_tp > 1:
            full = torch.empty(L, self.H, dtype=y.dtype, device=y.device)
            dist.all_gather_into_tensor(full, piece, group=self.g.attn_tp)
            piece = full
        return piece[: step.num_tokens].clone()

    # ---------- MLPs ----------
    def dense_mlp(self, i: int, x: torch.Tensor, prefix: str, inter: int, parts: int, idx: int):
        s = self.shard(inter, parts, idx)
        gate = self.linear(x, self.W(prefix + "gate_proj.weight", s))
        up = self.linear(x, self.W(prefix + "up_proj.weight", s))
        return self.linear(F.silu(gate) * up, self.W(prefix + "down_proj.weight", cols=s))

    def route(self, i: int, x: torch.Tensor):
        """Replicated router: softmax in fp32, top-k, optional renormalisation (transformers' router)."""
        logits = self.linear(x, self.W(f"model.layers.{i}.mlp.gate.weight"))
        probs = self.router_probs(logits)
        w, ids = torch.topk(probs, self.topk, dim=-1)
        weights = self.topk_weights(w).to(x.dtype)
        self._route = Route(ids, weights, logits)   # this rank's rows: reported as "routing" and its kin
        return weights, ids

    def router_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1, dtype=torch.float32)

    def topk_weights(self, w: torch.Tensor) -> torch.Tensor:
        return w / w.sum(-1, keepdim=True) if self.cfg.get("norm_topk_prob") else w

    def shared_expert(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Qwen2's shared expert, TP-sharded over the whole TP group, times sigmoid(gate(x))."""
        inter = self.cfg.get("shared_expert_intermediate_size") or 0
        if not inter:
            return None
        parts, idx = self.shared_expert_shard()
        y = self.dense_mlp(i, x, f"model.layers.{i}.mlp.shared_expert.", inter, parts, idx)
        return self.shared_gate(i, x) * y

    def shared_expert_shard(self) -> tuple[int, int]:
        """(parts, index): the shared expert's intermediate dimension is split over the whole TP group."""
        return self.lay.tp, self.rank

    def shared_gate(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x, self.W(f"model.layers.{i}.mlp.shared_expert_gate.weight")))

    def moe(self, i: int, x: torch.Tensor, n_real: int, counts: dict):
        """This rank's partial of the MoE block on all gathered rows; rows >= n_real are padding and are
        not dispatched (num_token_non_padded, B11)."""
        shared = self.shared_expert(i, x)
        w, ids = self.route(i, x)
        ids = self.mask_padding(ids, n_real)
        out = self.routed_experts(i, x, w, ids, counts)
        return self.combine(out, shared)

    def mask_padding(self, ids, n_real):
        ids = ids.clone()
        ids[n_real:] = -1
        return ids

    def routed_experts(self, i, x, w, ids, counts):
        """This rank's local experts on their rows, weighted: one grouped GEMM per projection where the device
        has one (the fused / grouped MoE kernels SGLang and vLLM run), else the per-expert loop."""
        local = self.local_experts()
        if self.grouped_experts(x) and local.step == 1 and len(local):
            return self.routed_experts_grouped(i, x, w, ids, counts, local)
        return self.routed_experts_loop(i, x, w, ids, counts)

    def grouped_experts(self, x: torch.Tensor) -> bool:
        """Grouped GEMM for bf16 on CUDA (torch's grouped_mm: SM80+); the per-expert loop elsewhere (the CPU tier,
        float32 / float64, and the EXPERTS_LOOP variant)."""
        return x.device.type == "cuda" and x.dtype == torch.bfloat16 and _grouped_mm() is not None

    def expert_stack(self, i: int, local: range) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards of its local experts, stacked: gate|up [E_local, 2 * I_shard, H] and down
        [E_local, H, I_shard], cached per layer (the same slices `dense_mlp` takes per expert)."""
        key = ("expert-stack", i, local.start, local.stop)
        if key not in self._cache:
            p = f"model.layers.{i}.mlp.experts."
            s = self.shard(self.cfg["moe_intermediate_size"], self.lay.moe_tp, self.moe_tp_rank)
            gu = [torch.cat([self.w[f"{p}{e}.gate_proj.weight"][s], self.w[f"{p}{e}.up_proj.weight"][s]]) for e in local]
            down = [self.w[f"{p}{e}.down_proj.weight"][:, s] for e in local]
            self._cache[key] = tuple(torch.stack(t).to(self.dt).to(self.dev).contiguous() for t in (gu, down))
        return self._cache[key]

    def routed_experts_grouped(self, i, x, w, ids, counts, local: range):
        """Slots (row, k) routed to a local expert, sorted by expert; gate|up and down as grouped GEMMs over the
        expert groups; each slot's output times its routing weight; a row's k slots added in expert order in
        `expert_accumulator_dtype` (default: the dtype, as the per-expert loop and transformers' eager experts).
        That is the habit with the most roundings (k - 1 where fused kernels' float32 sum makes 1): the spec is
        also the precision test's layout reference, so a correct target with that habit at a TP / EP layout has
        a legitimate sample of both its habit and the layout's roundings (with the float32 sum here, the H200
        read EXPERTS_LOOP at tp4-dp2-ep1 as a precision fault: +0.051, z = 81, 2026-12-04)."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        mine = ((flat >= local.start) & (flat < local.stop)).nonzero().squeeze(1)
        expert = flat[mine] - local.start
        expert, order = torch.sort(expert, stable=True)
        mine = mine[order]
        per_expert = torch.bincount(expert, minlength=len(local))
        for e, c in zip(local, per_expert.tolist()):      # host syncs: here and nonzero above
            counts[e] = counts.get(e, 0) + c
        slots = torch.zeros(n * k, x.shape[1], dtype=x.dtype, device=x.device)
        if mine.numel():
            gu_w, down_w = self.expert_stack(i, local)
            offs = per_expert.cumsum(0).to(torch.int32)
            mm = _grouped_mm()
            gate, up = mm(x[mine // k], gu_w.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            y = mm(F.silu(gate) * up, down_w.transpose(-2, -1), offs=offs)
            slots[mine] = y * w.reshape(-1)[mine, None]
        slots = slots.view(n, k, x.shape[1]).gather(1, ids.argsort(dim=1, stable=True)[..., None].expand(-1, -1, x.shape[1]))
        acc = slots[:, 0].to(self.expert_accumulator_dtype or x.dtype)   # slots of other ranks' experts are 0
        for j in range(1, k):
            acc = acc + slots[:, j]
        return acc.to(x.dtype)

    def routed_experts_loop(self, i, x, w, ids, counts):
        p = f"model.layers.{i}.mlp.experts."
        inter = self.cfg["moe_intermediate_size"]
        out = torch.zeros(x.shape, dtype=self.expert_accumulator_dtype or x.dtype, device=x.device)
        for e in self.local_experts():
            rows, slot = torch.where(ids == e)
            counts[e] = counts.get(e, 0) + int(rows.numel())
            if rows.numel() == 0:
                continue
            y = self.dense_mlp(i, x[rows], f"{p}{e}.", inter, self.lay.moe_tp, self.moe_tp_rank)
            out.index_add_(0, rows, (y * w[rows, slot, None]).to(out.dtype))
        return out.to(x.dtype)

    # the expert outputs' running sum: the activation dtype as transformers' eager loop (None), or float32 as
    # fused MoE kernels accumulate (a legitimate variant: checks/catalog/variants.py)
    expert_accumulator_dtype: torch.dtype | None = None

    def combine(self, routed, shared):
        return routed if shared is None else routed + shared

    def mlp(self, i: int, x: torch.Tensor, n_real: int, counts: dict) -> torch.Tensor:
        if self.is_sparse(i):
            return self.moe(i, x, n_real, counts)
        return self.dense_mlp(i, x, f"model.layers.{i}.mlp.", self.cfg["intermediate_size"], self.lay.tp, self.rank)

    def mlp_local(self, i: int, x: torch.Tensor, counts: dict) -> torch.Tensor:
        """dp == 1: the MLP on this rank's own rows (no gather), routing recorded."""
        self._route = None
        y = self.mlp(i, x, x.shape[0], counts)
        self.keep_route(i, 0, x.shape[0])
        return y

    def mlp_on_buffer(self, i, x, step, mode, counts):
        if mode == SUM_LEN:
            self._route = None
            y = self.mlp(i, x, x.shape[0], counts)
            self.keep_route(i, *self.slot(step, mode))
            return y
        return self.mlp_padded(i, x, step, counts)

    def keep_route(self, i: int, start: int, n: int):
        """Record the experts this rank's own rows were routed to at layer i (sparse layers only)."""
        if getattr(self, "_route", None) is not None:
            self.routes[i] = self._route.rows(start, n)
        self._route = None

    def mlp_block(self, i: int, x_local: torch.Tensor, step: Step, mode: str | None, counts: dict):
        """The MLP as a unit: gather (replicate) -> MLP -> reduce -> scatter; dp == 1: all-reduce only."""
        if self.lay.dp == 1:
            return self.mlp_all_reduce(i, self.mlp_local(i, x_local, counts))
        buf = self.gather(x_local, step, mode, partial=False)
        return self.reduce_and_scatter(self.mlp_on_buffer(i, buf, step, mode, counts), step, mode)

    def mlp_padded(self, i, buf, step, counts):
        """MAX_LEN buffer: DP slots of L rows, each padded past its count; pad rows are not dispatched."""
        counts_dp = step.batch.tokens_per_dp()
        L = self.max_len(counts_dp)
        order = torch.cat([torch.arange(d * L, d * L + c) for d, c in enumerate(counts_dp)] +
                          [torch.arange(d * L + c, (d + 1) * L) for d, c in enumerate(counts_dp)])
        y = torch.zeros_like(buf)
        n_real = sum(counts_dp)
        self._route = None
        y[order] = self.mlp(i, buf[order], n_real, counts)
        self.keep_route(i, sum(counts_dp[: self.dp_rank]), counts_dp[self.dp_rank])
        return y

    def mlp_all_reduce(self, i: int, y: torch.Tensor) -> torch.Tensor:
        if self.lay.tp > 1:
            self.all_reduce(y, self.g.tp)
        return y

    # ---------- decoder layer ----------
    def layer(self, i: int, step: Step, hidden: torch.Tensor, residual: torch.Tensor | None,
              kv_inputs: list[torch.Tensor], counts: dict):
        """One decoder layer on this rank's extend rows. kv_inputs: per request, the normed hidden of the
        prefix rows whose K/V are not cached (empty when self.kv_prefix holds them). Returns (hidden,
        residual) with the residual add deferred, as sglang's fused add-RMSNorm does."""
        p = f"model.layers.{i}."
        if residual is None:
            residual, hidden = hidden, self.norm(hidden, self.W(p + "input_layernorm.weight"))
        else:
            residual = hidden + residual
            hidden = self.norm(residual, self.W(p + "input_layernorm.weight"))
        xs, start = [], 0
        for req, pre in zip(step.requests, kv_inputs):
            xs.append(torch.cat([pre, hidden[start: start + req.extend]]))
            start += req.extend
        attn = self.attention(i, step, xs)
        mode = self.padding_mode(step)
        post_w = self.W(p + "post_attention_layernorm.weight")
        if self.lay.dp == 1:
            if self.lay.tp > 1:
                self.all_reduce(attn, self.g.tp)
            residual = attn + residual
            y = self.mlp_local(i, self.norm(residual, post_w), counts)
            return self.mlp_all_reduce(i, y), residual
        local = attn + residual if self.folds_residual() else attn
        buf = self.gather(local, step, mode, partial=True)
        residual = self.scatter(buf, step, mode)
        y = self.mlp_on_buffer(i, self.norm(buf, post_w), step, mode, counts)
        return self.reduce_and_scatter(y, step, mode), residual

    # ---------- embedding and lm_head ----------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Replicated under DP attention (sglang: VocabParallelEmbedding(enable_tp=not dp_attention));
        vocab-parallel over TP with an all-reduce otherwise."""
        w = self.W("model.embed_tokens.weight")
        if self.lay.dp > 1 or self.lay.tp == 1:
            return F.embedding(ids, w)
        V = w.shape[0]
        s = self.shard(V, self.lay.tp, self.rank)
        local = ids - s.start
        inside = (local >= 0) & (local < s.stop - s.start)
        out = F.embedding(torch.where(inside, local, 0), w[s]) * inside[:, None].to(w.dtype)
        self.all_reduce(out, self.g.tp)
        return out

    def lm_head(self, h: torch.Tensor, step: Step) -> torch.Tensor:
        """Vocab-parallel lm_head. DP attention without dp-lm-head: gather every DP group's rows, shard the
        vocab over TP, all-gather the vocab, scatter back (sglang LogitsProcessor). dp-lm-head: the vocab
        is sharded over the attention-TP group and gathered there."""
        V = self.cfg["vocab_size"]
        if self.lay.dp_lm_head:
            return self.vocab_parallel(h, self.lay.attn_tp, self.attn_tp_rank, self.g.attn_tp)
        if self.lay.dp == 1:
            return self.vocab_parallel(h, self.lay.tp, self.rank, self.g.tp)
        mode = SUM_LEN   # logits gather always sums (sglang dp_gather_replicate in the logits processor)
        buf = self.gather(h, step, mode, partial=False)
        logits = self.vocab_parallel(buf.clone(), self.lay.tp, self.rank, self.g.tp)
        off, n = self.slot(step, mode)
        assert logits.shape[1] == V
        return logits[off: off + n].clone()

    def vocab_parallel(self, h, parts, idx, group):
        W = self.W("lm_head.weight", self.shard(self.cfg["vocab_size"], parts, idx))
        part = self.linear(h, W)
        if parts == 1:
            return part
        rows, cols = part.shape
        out = torch.empty(parts * rows, cols, dtype=part.dtype, device=part.device)
        dist.all_gather_into_tensor(out, part.contiguous(), group=group)
        return out.view(parts, rows, cols).permute(1, 0, 2).reshape(rows, parts * cols)

    # ---------- the whole model ----------
    def forward_model(self, step: Step, kv: dict | None, counts: dict) -> tuple[torch.Tensor, list, dict]:
        """One forward over this rank's extend tokens. kv[(layer, request)] = (k, v): the KV cache of the
        request's prefix (empty or None: no prefix). Returns (logits, per-layer outputs, the K/V of every
        request after this forward, for the next)."""
        ids = torch.cat([t[r.prefix:] for r, t in zip(step.requests, step.inputs)]) if step.requests else \
            torch.zeros(0, dtype=torch.long)
        hidden, residual = self.embed(ids.to(self.dev)), None
        self.routes = {}
        self.kv_prefix, self.kv_new = dict(kv or {}), {}
        none = [torch.zeros(0, self.H, dtype=self.dt, device=self.dev) for _ in step.requests]
        layers = []
        for i in range(self.cfg["num_hidden_layers"]):
            hidden, residual = self.layer(i, step, hidden, residual, none, counts)
            layers.append(hidden + residual)
        final = self.norm(hidden + residual, self.W("model.norm.weight"))
        new, self.kv_prefix, self.kv_new = self.kv_new, {}, {}
        return self.lm_head(final, step), layers, new


class SpecTarget:
    """The protocol object for SpecModel (and its mutants: set `model_class`)."""
    name = "spec"
    units = UNITS
    # The spec mirrors SGLang's Qwen2-MoE / Qwen3-MoE path (softmax routing, full RoPE, Qwen's dense-layer rule,
    # Qwen2's gated shared expert): other families run under the sglang target and outside targets.
    unsupported_families = {
        "glm4_moe": "the spec implements Qwen2-MoE / Qwen3-MoE only (softmax router, full rotary, gated shared "
                    "expert); GLM-4.5-MoE's sigmoid router with correction bias, routed scaling, partial rotary "
                    "and ungated shared experts run under the sglang target",
        "deepseek_v3": "the spec implements Qwen2-MoE / Qwen3-MoE only (GQA attention, softmax router); "
                       "DeepSeek-V3's latent attention and group-limited sigmoid routing run under the sglang target",
        "minimax_m2": "the spec implements Qwen2-MoE / Qwen3-MoE only (per-head qk-norm, softmax router); "
                      "MiniMax-M2's whole-projection qk-norm, partial rotary and biased sigmoid routing run under "
                      "the sglang target",
        "gpt_oss": "the spec implements Qwen2-MoE / Qwen3-MoE only (full causal attention, unbiased experts); "
                   "GPT-OSS's sliding windows, attention sinks, router bias and clamped biased experts run under "
                   "the sglang target",
    }
    sessions = True          # keeps KV caches across the steps of a serving session (run_model)
    model_class = SpecModel

    def build(self, unit: str, env: BuildEnv):
        return self.model_class(env)

    def run(self, m: SpecModel, step: Step) -> dict:
        unit = step.unit
        i = m.env.layer
        counts: dict = {}
        m.routes, m.kv_prefix, m.kv_new = {}, {}, {}
        out: dict = {"padding_mode": m.padding_mode(step) if m.lay.dp > 1 else None}
        with torch.no_grad():
            if unit == "moe":
                x = step.inputs[0].to(m.dt).to(m.dev)
                out["out"] = m.mlp_block(i, x, step, m.padding_mode(step), counts)
            elif unit == "attention":
                xs = [t.to(m.dt).to(m.dev) for t in step.inputs]
                y = m.attention(i, step, xs)
                if m.lay.attn_tp > 1:
                    m.all_reduce(y, m.g.attn_tp)   # standalone attention: o_proj reduces its group
                out["out"] = y
            elif unit == "decoder":
                xs = [t.to(m.dt).to(m.dev) for t in step.inputs]
                pre = [m.norm(x[: r.prefix], m.W(f"model.layers.{i}.input_layernorm.weight"))
                       for r, x in zip(step.requests, xs)]
                h = torch.cat([x[r.prefix:] for r, x in zip(step.requests, xs)]) if xs else \
                    torch.zeros(0, m.H, dtype=m.dt, device=m.dev)
                y, res = m.layer(i, step, h, None, pre, counts)
                out["out"] = y + res
            elif unit == "model":
                out.update(run_model(m, step))
                counts = out.pop("counts")
        out["expert_counts"] = counts
        out.update(Route.report(m.routes))
        return {k: to_cpu(v) for k, v in out.items()}


def run_model(m: SpecModel, step: Step) -> dict:
    """Prefix forward (fills the KV cache; ranks without prefix are idle in it), then the extend forward.
    In a serving session the prefix comes from the session's cache instead (serve_step)."""
    from dpep_parity.checks.core.batches import Batch, Request
    if step.serving is not None:
        return serve_step(m, step)
    kv: dict = {}
    prefix_batch = Batch(tuple(tuple(Request(0, r.prefix) for r in reqs if r.prefix) for reqs in step.batch.per_dp),
                         step.batch.seed)
    if not prefix_batch.nobody_runs:
        which = [j for j, r in enumerate(step.requests) if r.prefix]
        pstep = Step(prefix_batch, step.rank, step.dp_rank, tuple(Request(0, step.requests[j].prefix) for j in which),
                     [step.inputs[j][: step.requests[j].prefix] for j in which])
        _, _, pkv = m.forward_model(pstep, None, {})
        kv = {(i, which[jj]): pair for (i, jj), pair in pkv.items()}
    counts: dict = {}
    logits, layers, _ = m.forward_model(step, kv, counts)
    return {"logits": logits, "layers": layers, "counts": counts}


def serve_step(m: SpecModel, step: Step) -> dict:
    """One step of a serving session: each request's KV cache (per layer, the K and V of its tokens) lives in
    the built model under (session, request id) and grows by the rows this step computes; released
    requests' caches are dropped, and so is every other session."""
    sv = step.serving
    for other in [k for k in m.sessions if k != sv.session]:
        del m.sessions[other]
    store = m.sessions.setdefault(sv.session, {})
    for rid in sv.released:
        store.pop(rid, None)
    kv = {}
    for j, (r, rid) in enumerate(zip(step.requests, sv.ids)):
        cached = store.get(rid, {})
        have = cached[0][0].shape[0] if cached else 0
        if have != r.prefix:
            raise RuntimeError(f"spec serving: request {rid} extends after {r.prefix} tokens but its cache "
                               f"holds {have}")
        kv.update({(i, j): pair for i, pair in cached.items()})
    counts: dict = {}
    logits, layers, new = m.forward_model(step, kv, counts)
    for (i, j), pair in new.items():
        store.setdefault(sv.ids[j], {})[i] = pair
    return {"logits": logits, "layers": layers, "counts": counts}


SPEC = SpecTarget()
