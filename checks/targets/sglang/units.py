"""The four units of the `sglang` target, each driving SGLang's own modules of the whole model built by
`session` (imported only on the ranks).

- moe: layer i's MLP through SGLang's FFN boundary path (dp_gather -> block -> the exit SGLang selects).
- attention: layer i's `self_attn` (QKVParallelLinear over attention TP with KV replication, qk-norm, RoPE,
  RadixAttention on the torch-native backend over the KV pools), its output summed over the group it
  declares (`sum_output(..., SumGroup.ATTN_TP)`).
- decoder: layer i's `forward` (its attention and FFN stage boundaries: residual stream, DP gather /
  scatter, padding, the MoE or dense MLP); the layer output (residual + contribution) is read through
  SGLang's own final-norm path with capture, which completes a sum the layer left deferred.
- model: `Model.forward` (embedding, every layer, final norm, the logits processor with its DP gather and
  `dp_lm_head`); logits of every extend token.

Every unit that reads a KV cache first runs a priming step over the requests' prefixes (collective under DP,
idle ranks included, like any step), then the step under test: extend, decode or idle, with SGLang's own
padding. Reported besides the output: SGLang's padding mode, the rows its dispatcher hands the experts, and the
experts its router chose for this rank's own rows (per sparse layer).
"""
from __future__ import annotations

import torch

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.targets.protocol import BuildEnv, Route, Step, to_cpu
from dpep_parity.checks.targets.sglang.batch import (
    forward_batch,
    gathered_start,
    prefix_batch,
    request_rows,
    running,
)
from dpep_parity.checks.targets.sglang.session import Handle, session_for


def run(h: Handle, step: Step) -> dict:
    s = session_for(h.env, h.placement, h.options)
    with torch.no_grad():
        if step.serving is not None and h.unit == "model":
            out = serve_model(s, h.env, step)
        else:
            reqs = step.requests
            s.pools.ensure(tokens=sum(r.total for r in reqs) + 1, rows=len(reqs) + 1,
                           context=max((r.total for r in reqs), default=1))
            s.pools.reset()
            s.serving = None
            out = UNITS[h.unit](s, h.env, step)
    return {k: to_cpu(v) for k, v in out.items()}


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if rows > x.shape[0] else x


def _mode(fb, dp: int) -> str | None:
    mode = fb.dp_padding_mode
    return None if dp == 1 or mode is None else ("max_len" if mode.is_max_len() else "sum_len")


def _part(step: Step, part: str, empty: torch.Tensor) -> torch.Tensor:
    """This rank's inputs (hidden rows or token ids) of every request, prefix part or extend part,
    concatenated (`empty` when there are none)."""
    pieces = [t[: r.prefix] if part == "prefix" else t[r.prefix:] for r, t in zip(step.requests, step.inputs)]
    return torch.cat(pieces) if pieces else empty


def _hidden(env: BuildEnv, step: Step, part: str) -> torch.Tensor:
    empty = torch.zeros(0, env.config["hidden_size"])
    return _part(step, part, empty).to(env.dtype).to(env.device)


def _prime(s, step: Step, rows: list[int], run_one) -> None:
    """The priming step over the prefixes (skipped when no request has one: no rank would run it)."""
    pb = prefix_batch(step.batch)
    if pb.nobody_runs:
        return
    prow = [row for r, row in zip(step.requests, rows) if r.prefix]
    run_one(pb, prow)


# ---------------------------------------------------------------- moe
def run_moe(s, env: BuildEnv, step: Step) -> dict:
    """The MLP of layer env.layer as a unit, through SGLang's FFN boundary path: the DP gather of every DP
    rank's rows (dp_gather_replicate into the global DP buffer), the block on the gathered buffer, then the
    exit SGLang's ExitPolicy selects (dp_reduce_scatter(v) completing the sum, or the MoE output's sum over
    its group followed by dp_scatter); without DP attention the MoE output's sum alone."""
    lay = env.layout
    x = step.inputs[0].to(env.dtype).to(env.device)
    n = x.shape[0]
    block = ffn_block(s.model.model.layers[env.layer])
    rows = request_rows(s.pools, len(step.requests))
    fb = forward_batch(s, step.batch, step.dp_rank, rows, None)
    x = _padded(x, fb.input_ids.shape[0])          # this rank's rows after SGLang's padding
    taps = Taps(s, [env.layer], n)
    with running(s, fb), taps.around(fb):
        out = s.adapter.moe(s, fb, block, x, lay.dp)
    return {"out": out[:n].clone(), "padding_mode": _mode(fb, lay.dp), **taps.report()}


# ---------------------------------------------------------------- attention
def run_attention(s, env: BuildEnv, step: Step) -> dict:
    """Layer i's self-attention on the normed input of each request (prefix rows primed into the KV cache).
    No collective inside (column-parallel QKV, row-parallel o_proj without reduction); the output's sum over
    attention TP is SGLang's `sum_output` for the group the attention declares. An attention-TP group holds
    one DP rank's rows, so its members have the same row count and call the sum together."""
    attn = s.model.model.layers[env.layer].self_attn
    rows = request_rows(s.pools, len(step.requests))

    def attend(batch: Batch, req_rows, x):
        fb = forward_batch(s, batch, step.dp_rank, req_rows, None)
        x = _padded(x, fb.input_ids.shape[0])
        with running(s, fb):
            y = s.adapter.attend(s, attn, fb, x) if x.shape[0] else x
            if y.shape[0]:
                y = s.adapter.attention_sum(y, fb)
        return fb, y

    _prime(s, step, rows, lambda pb, prow: attend(pb, prow, _hidden(env, step, "prefix")))
    x = _hidden(env, step, "extend")
    fb, y = attend(step.batch, rows, x)
    return {"out": y[: x.shape[0]].clone(), "padding_mode": _mode(fb, env.layout.dp)}


# ---------------------------------------------------------------- decoder
def run_decoder(s, env: BuildEnv, step: Step) -> dict:
    """Layer i's forward on each request's residual stream (prefix rows primed through the same layer)."""
    layer = s.model.model.layers[env.layer]
    rows = request_rows(s.pools, len(step.requests))

    def forward(batch: Batch, req_rows, x, taps=None):
        fb = forward_batch(s, batch, step.dp_rank, req_rows, None)
        x = _padded(x, fb.input_ids.shape[0])
        with running(s, fb), (taps.around(fb) if taps else _nothing()):
            y = s.adapter.decoder(s, layer, fb, x)
        return fb, x[:0] if y is None else y

    _prime(s, step, rows, lambda pb, prow: forward(pb, prow, _hidden(env, step, "prefix")))
    x = _hidden(env, step, "extend")
    taps = Taps(s, [env.layer], x.shape[0])
    fb, y = forward(step.batch, rows, x, taps)
    return {"out": y[: x.shape[0]].clone(), "padding_mode": _mode(fb, env.layout.dp), **taps.report()}


# ---------------------------------------------------------------- model
def run_model(s, env: BuildEnv, step: Step) -> dict:
    """Model.forward: priming over the prefixes, then the step. Logits of every extend token: in a step
    where some DP rank extends, the post-norm hidden states of every token (CaptureHiddenMode.FULL) go
    through the logits processor's own `_get_logits` (DP gather, lm_head over TP or attention TP with
    dp_lm_head, vocabulary gather, DP scatter), the function its sampled and input-logprob paths call; in
    an all-decode step the logits processor's own output (`next_token_logits`, one row per request) is it.
    Per-layer outputs: each layer's capture option (the residual its attention boundary reads, i.e. the
    previous layer's output on this rank's rows) and the final norm's updated residual (the last layer's)."""
    model = s.model
    rows = request_rows(s.pools, len(step.requests))

    def prime(pb, prow):
        fb = forward_batch(s, pb, step.dp_rank, prow, _part(step, "prefix", torch.zeros(0, dtype=torch.long)))
        with running(s, fb):
            model.forward(fb.input_ids, fb.positions, fb)

    _prime(s, step, rows, prime)
    return _model_step(s, env, step, rows)


class ServingState:
    """A serving session's requests in SGLang's pools: each request keeps its request row (and behind it
    its token slots) from the step that admits it to the step after it finishes."""

    def __init__(self, session: str):
        self.session = session
        self.rows: dict[int, int] = {}
        self.tokens: dict[int, int] = {}


def serve_model(s, env: BuildEnv, step: Step) -> dict:
    """A step of a serving session (Step.serving): no priming, every request's prefix is already in SGLang's
    KV cache from the session's earlier steps. A new session sizes the pools for its capacity and clears
    them; released requests give their token slots and request row back to SGLang's allocators."""
    sv = step.serving
    pools, st = s.pools, s.serving
    if st is None or st.session != sv.session:
        tokens, requests, longest = sv.capacity
        pools.ensure(tokens=tokens + 1, rows=requests + 1, context=longest)
        pools.reset()
        st = s.serving = ServingState(sv.session)
    for rid in sv.released:
        row = st.rows.pop(rid, None)
        if row is not None:
            pools.release(row, st.tokens.pop(rid))
    for r, rid in zip(step.requests, sv.ids):
        if rid not in st.rows:
            if r.prefix:
                raise RuntimeError(f"sglang serving: request {rid} extends after {r.prefix} tokens it never sent")
            st.rows[rid] = request_rows(pools, 1)[0]
        elif st.tokens[rid] != r.prefix:
            raise RuntimeError(f"sglang serving: request {rid} extends after {r.prefix} tokens, its cache "
                               f"holds {st.tokens[rid]}")
        st.tokens[rid] = r.total
    return _model_step(s, env, step, [st.rows[rid] for rid in sv.ids])


def _model_step(s, env: BuildEnv, step: Step, rows: list[int]) -> dict:
    """The step under test of the model unit: its requests' prefixes are in the KV cache behind `rows`."""
    model = s.model
    n_layers = len(model.model.layers)
    ids = _part(step, "extend", torch.zeros(0, dtype=torch.long))
    n = ids.shape[0]
    full = step.batch.is_extend_in_batch
    fb = forward_batch(s, step.batch, step.dp_rank, rows, ids, capture_full=full)
    sparse = [i for i, layer in enumerate(model.model.layers) if _experts(layer) is not None]
    taps = Taps(s, sparse, n, count=False)
    layers = _LayerCapture(model, n, s.adapter)
    with running(s, fb), taps.around(fb), layers:
        out = model.forward(fb.input_ids, fb.positions, fb)
    V = env.config["vocab_size"]
    if full:
        logits = _all_logits(s, step, fb, out.hidden_states, n)
    else:
        logits = out.next_token_logits if out.next_token_logits is not None else torch.zeros(0, V)
    result = {"logits": logits[:n].to(env.dtype).clone(), "padding_mode": _mode(fb, env.layout.dp),
              **taps.report()}
    got = layers.result(n_layers)
    if got is not None:
        result["layers"] = got
    return result


def _all_logits(s, step: Step, fb, hidden, n: int) -> torch.Tensor:
    """The logits processor's `_get_logits` on every token's post-norm hidden state, with the DP metadata
    the scheduler gives a batch whose every token is sampled (input logprobs from position 0)."""
    from sglang.srt.layers.logits_processor import LogitsMetadata
    lp = s.model.logits_processor
    H = s.env.config["hidden_size"]
    hidden = hidden[:n] if hidden is not None else torch.zeros(0, H, dtype=s.env.dtype, device=s.env.device)
    md = LogitsMetadata.from_forward_batch(fb)
    if s.env.layout.dp > 1:
        counts = step.batch.tokens_per_dp()
        md.global_num_tokens_for_logprob_cpu = list(counts)
        md.global_num_tokens_for_logprob_gpu = torch.tensor(counts, dtype=torch.int64, device=s.env.device)
        md.dp_local_start_pos = md.dp_local_num_tokens = None
    with running(s, fb):
        return lp._get_logits(hidden, s.model.lm_head, md)


class _LayerCapture:
    """Per-layer outputs through SGLang's own capture points: layer i's capture keyword (called
    with the residual its attention boundary produced, the output of layer i-1, on the producer's rows)
    added by a forward pre-hook, and the final norm's returned residual (the last layer's output) read by
    a forward hook. Reported only when every layer gave this rank's rows."""

    def __init__(self, model, n: int, adapter):
        self.model, self.n, self.adapter = model, n, adapter
        self.got: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self):
        layers = self.model.model.layers
        for i in range(1, len(layers)):
            def pre(mod, args, kwargs, i=i):
                kwargs.update(self.adapter.capture_kwargs(
                    type(layers[0]), lambda v, i=i: self.got.setdefault(i - 1, v.detach().clone())))
                return args, kwargs
            self.handles.append(layers[i].register_forward_pre_hook(pre, with_kwargs=True))

        last = len(layers) - 1

        def post(mod, args, out):
            if isinstance(out, tuple) and len(out) == 2:
                self.got.setdefault(last, out[1].detach().clone())
        self.handles.append(self.model.model.norm.register_forward_hook(post))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def result(self, n_layers: int):
        if set(self.got) != set(range(n_layers)) or any(v.shape[0] < self.n for v in self.got.values()):
            return None
        return [self.got[i][: self.n] for i in range(n_layers)]


# ---------------------------------------------------------------- instrumentation
def ffn_block(layer):
    """A decoder layer's MLP or MoE block: `mlp` in most of SGLang's model files, `block_sparse_moe` in
    MiniMax-M2's (and Mixtral's)."""
    block = getattr(layer, "mlp", None)
    return block if block is not None else getattr(layer, "block_sparse_moe", None)


def _experts(layer):
    return getattr(ffn_block(layer), "experts", None)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Taps:
    """What SGLang's MoE blocks did in one forward, read by forward hooks (instrumentation only):
    - routing: the top-k experts SGLang's router (the block's `topk`, a TopK module) chose, for this rank's own
      rows of the buffer the block ran on (the DP-gathered buffer under DP attention), sorted per row, with
      the weights it gave them (in the same order) and the router logits it read (the router-weights check);
    - expert counts: rows each local expert received, from what the token dispatcher hands the expert
      runner (StandardDispatcher.dispatch output; local ids under EP, -1 for dropped slots).
    Both name the logical expert whose weights the slot holds: the router's output and the dispatcher's ids are
    physical slots (the same ids under SGLang's trivial placement), read through the published placement's
    physical_to_logical_map, so what is reported is the expert a row is really computed with.
    A layer whose router saw a buffer of another size than SGLang's prepared layout says is not reported."""

    def __init__(self, s, layers: list[int], n: int, count: bool = True):
        self.s, self.layers, self.n, self.count = s, layers, n, count
        self.routing: dict[int, Route] = {}
        self.counts: dict[int, int] = {}
        self.unreported: list[str] = []
        self._undo: list = []

    def around(self, fb):
        self.fb = fb
        return self

    def __enter__(self):
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
        placed = get_global_expert_location_metadata()
        self.logical = None if placed is None else placed.physical_to_logical_map.cpu()
        model_layers = self.s.model.model.layers
        start = gathered_start(self.s, self.fb)
        rows = sum(self.fb.global_num_tokens_cpu) if self.fb.global_num_tokens_cpu is not None \
            else self.fb.input_ids.shape[0]
        for i in self.layers:
            experts = _experts(model_layers[i])
            if experts is None:
                continue
            topk = ffn_block(model_layers[i]).topk

            def hook(mod, args, kwargs, out, i=i):
                ids = getattr(out, "topk_ids", None)
                if not isinstance(ids, torch.Tensor):
                    return
                if ids.shape[0] != rows:
                    self.unreported.append(f"layer {i}: router saw {ids.shape[0]} rows, layout says {rows}")
                    return
                weights = getattr(out, "topk_weights", None)
                logits = args[1] if len(args) > 1 else kwargs.get("router_logits")
                whole = isinstance(weights, torch.Tensor) and isinstance(logits, torch.Tensor) and \
                    weights.shape == ids.shape and logits.shape[0] == rows
                self.routing[i] = Route(self._logical(i, ids), weights if whole else None,
                                        logits if whole else None).rows(start, self.n)
            self._undo.append(topk.register_forward_hook(hook, with_kwargs=True).remove)
            if self.count:
                self._count(i, experts)
        return self

    def _logical(self, layer: int, physical: torch.Tensor) -> torch.Tensor:
        if self.logical is None:
            return physical
        return self.logical[layer][physical.cpu().long()].to(device=physical.device, dtype=physical.dtype)

    def _count(self, layer: int, experts):
        d = getattr(experts, "dispatcher", None)
        if d is None or not hasattr(d, "dispatch"):
            return
        original = d.dispatch

        def dispatch(*args, **kwargs):
            out = original(*args, **kwargs)
            ids = getattr(getattr(out, "topk_output", None), "topk_ids", None)
            if isinstance(ids, torch.Tensor):
                local = getattr(d, "local_expert_mapping", None) is not None
                base = d.moe_ep_rank * d.num_local_routed_experts if local else 0
                for e in self._logical(layer, ids[ids >= 0].flatten() + base).tolist():
                    self.counts[e] = self.counts.get(e, 0) + 1
            return out
        d.dispatch = dispatch
        self._undo.append(lambda: vars(d).pop("dispatch", None))

    def __exit__(self, *exc):
        for undo in self._undo:
            undo()
        self._undo = []

    def report(self) -> dict:
        out: dict = {}
        if self.count:
            out["expert_counts"] = dict(self.counts)
        if self.routing and not self.unreported:
            out.update(Route.report(self.routing))
        return out


UNITS = {"moe": run_moe, "attention": run_attention, "decoder": run_decoder, "model": run_model}
