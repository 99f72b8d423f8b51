"""The single-device oracle: Hugging Face transformers' own Qwen2-MoE / Qwen3-MoE modules, code that no
engine under test shares. Loaded from the fixture directory (never cast in memory: transformers keeps the
rotary inv_freq in fp32 on load) in float64 for the truth and in the test dtype for the reference.

Devices: the reference (test dtype) runs on the device of the system under test, so that its rounding is
the rounding of the same kernels (cuBLAS on CUDA, which may reduce bf16 GEMMs in another order than the
CPU does); the float64 truth may run anywhere (`truth_device`, default: the same device). Inputs are CPU
tensors; every tensor a UnitRef holds is back on the CPU.

Rows are the extend tokens of every request, in global order (DP rank, then request, then position).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from dpep_parity.checks.batches import DTYPES, Batch


@dataclass
class UnitRef:
    truth: torch.Tensor                      # [rows, cols] float64
    ref: torch.Tensor                        # [rows, cols] in dtype
    # per sparse layer: router probabilities of every row (truth, ref), for near-tie detection
    router: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    layers_truth: list[torch.Tensor] = field(default_factory=list)   # model: per-layer outputs (rows)
    layers_ref: list[torch.Tensor] = field(default_factory=list)


@functools.lru_cache(maxsize=8)
def load_model(model_dir: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    kw = dict(dtype=DTYPES[dtype], attn_implementation="eager")
    try:
        m = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", **kw)
    except TypeError:   # transformers 4.x has no experts_implementation
        m = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    if device != "cpu":
        m = m.to(device)   # moves storage only: the fp32 rotary inv_freq stays fp32
    return m.eval()


def resolve_device(device: str | None) -> str:
    """'cpu', 'cuda' (the current CUDA device of this process), 'cuda:N', or 'auto'."""
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def _causal_mask(n: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    m = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return m[None, None]


def _dev(model) -> torch.device:
    return next(model.parameters()).device


class Oracle:
    """`device`: where the reference in the test dtype runs (the system under test's device);
    `truth_device`: where the float64 truth runs (default: `device`)."""

    def __init__(self, model_dir: str, dtype: str, device: str = "cpu", truth_device: str | None = None):
        self.dir, self.dtype_name = str(model_dir), dtype
        self.dtype = DTYPES[dtype]
        self.device = resolve_device(device)
        self.truth_device = resolve_device(truth_device) if truth_device else self.device
        self.truth_model = load_model(self.dir, "float64", self.truth_device)
        self.ref_model = load_model(self.dir, dtype, self.device)
        self.config = self.truth_model.config

    def _both(self):
        return ((self.truth_model, torch.float64), (self.ref_model, self.dtype))

    @torch.no_grad()
    def mlp(self, layer: int, x: torch.Tensor) -> UnitRef:
        """The layer's MLP block (sparse MoE or dense) on rows x [rows, hidden]."""
        outs, probs = [], []
        for model, dt in self._both():
            block = model.model.layers[layer].mlp
            with _RouterTap(model) as tap:
                outs.append(block(x.to(dt).to(_dev(model))[None]).reshape(x.shape[0], -1).cpu())
            probs.append(tap.probs(layer))
        return UnitRef(outs[0], outs[1], [tuple(probs)] if probs[0] is not None else [])

    @torch.no_grad()
    def per_request(self, batch: Batch, seqs: list[torch.Tensor], fn, layers: list[int]) -> UnitRef:
        """`fn(model, h, position_embeddings, mask)` on each request's sequence (prefix + extend) alone; the
        extend rows, and the router probabilities of `layers` (the sparse ones among them)."""
        res = []
        for model, dt in self._both():
            rows, taps = [], []
            dev = _dev(model)
            for (_, _, req), h in zip(batch.requests_flat(), seqs):
                pos = torch.arange(req.total, device=dev)[None]
                h = h.to(dt).to(dev)[None]
                pe = model.model.rotary_emb(h, pos)
                with _RouterTap(model) as tap:
                    out = fn(model, h, pe, _causal_mask(req.total, dt, dev))
                rows.append(out[0, req.prefix:].cpu())
                taps.append([tap.probs(i, start=req.prefix) for i in layers])
            res.append((_cat(rows, self.config.hidden_size, dt), taps))
        router = _merge_router(res[0][1], res[1][1], len(layers))
        return UnitRef(res[0][0], res[1][0], router)

    @torch.no_grad()
    def model(self, batch: Batch, token_ids: list[torch.Tensor]) -> UnitRef:
        """Logits of every extend token, per-layer hidden states, and router probabilities of every token
        (prefix tokens included: a tie in the prefix changes the cache the extend tokens attend to)."""
        res = []
        n_layers = self.config.num_hidden_layers
        for model, dt in self._both():
            logits, hidden, taps = [], [[] for _ in range(n_layers)], []
            for (_, _, req), ids in zip(batch.requests_flat(), token_ids):
                outs: dict[int, torch.Tensor] = {}
                hooks = [layer.register_forward_hook(_keep_output(outs, i))
                         for i, layer in enumerate(model.model.layers)]
                try:   # hooks, not output_hidden_states: its last entry is after the final norm
                    with _RouterTap(model) as tap:
                        out = model(input_ids=ids[None].to(_dev(model)))
                finally:
                    for h in hooks:
                        h.remove()
                logits.append(out.logits[0, req.prefix:].cpu())
                for i in range(n_layers):
                    hidden[i].append(outs[i][0, req.prefix:].cpu())
                taps.append([tap.probs(i) for i in range(n_layers)])
            v = self.config.vocab_size
            res.append((_cat(logits, v, dt), [_cat(h, self.config.hidden_size, dt) for h in hidden], taps))
        router = _merge_router(res[0][2], res[1][2], n_layers)
        return UnitRef(res[0][0], res[1][0], router, res[0][1], res[1][1])


    # The reference in the test dtype again, with the same rows computed among decoy rows or decoy requests:
    # GEMM blocking depends on the batch, so one token's rounding differs with its company (measured: a
    # qwen3-moe MoE row's fp32 error went from 1.3e-7 alone to 5.9e-7 among 8 rows). Together with the plain
    # reference these sample the error one device legitimately makes. Each unit picks its kind (checks.units).
    @torch.no_grad()
    def decoy_rows(self, layer: int, batch: Batch, x: torch.Tensor) -> list[torch.Tensor]:
        """The layer's MLP block on rows x among 1 and among 7 random decoy rows."""
        model, dt = self.ref_model, self.dtype
        g = torch.Generator().manual_seed(batch.seed + 1)
        block = model.model.layers[layer].mlp
        out = []
        for extra in (1, 7):
            decoys = torch.randn(extra, x.shape[1], generator=g, dtype=torch.float64).to(dt)
            out.append(block(torch.cat([x.to(dt), decoys]).to(_dev(model))[None])[0, : x.shape[0]].cpu())
        return out

    @torch.no_grad()
    def decoy_sequences(self, batch: Batch, seqs: list[torch.Tensor], fn) -> list[torch.Tensor]:
        """`fn` (as for per_request) on each request batched with two random decoy sequences of its length."""
        model, dt = self.ref_model, self.dtype
        dev, g = _dev(model), torch.Generator().manual_seed(batch.seed + 1)
        rows = []
        for (_, _, req), t in zip(batch.requests_flat(), seqs):
            h = torch.stack([t.to(dt), *(torch.randn(2, *t.shape, generator=g, dtype=torch.float64).to(dt))]).to(dev)
            pe = model.model.rotary_emb(h, torch.arange(req.total, device=dev)[None])
            rows.append(fn(model, h, pe, _causal_mask(req.total, dt, dev))[0, req.prefix:].cpu())
        return [_cat(rows, self.config.hidden_size, dt)]

    @torch.no_grad()
    def decoy_tokens(self, batch: Batch, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model's logits of each request batched with two random decoy requests of its length."""
        model, g = self.ref_model, torch.Generator().manual_seed(batch.seed + 1)
        rows = []
        for (_, _, req), t in zip(batch.requests_flat(), token_ids):
            ids = torch.stack([t, *torch.randint(0, self.config.vocab_size, (2, t.shape[0]), generator=g)])
            rows.append(model(input_ids=ids.to(_dev(model))).logits[0, req.prefix:].cpu())
        return [_cat(rows, self.config.vocab_size, self.dtype)]


def _keep_output(store: dict, i: int):
    def hook(mod, inp, out):
        store[i] = (out[0] if isinstance(out, tuple) else out).detach()
    return hook


def _cat(rows: list[torch.Tensor], cols: int, dt) -> torch.Tensor:
    return torch.cat(rows) if rows else torch.zeros(0, cols, dtype=dt)


def _merge_router(truth_taps, ref_taps, n_layers):
    """Per layer: ([tokens, experts] truth, ref) over all requests; None entries (dense layers) dropped.
    Keeps each request's tokens as a list so callers can map ties back to requests."""
    out = []
    for i in range(n_layers):
        t = [req[i] for req in truth_taps]
        r = [req[i] for req in ref_taps]
        if t and t[0] is not None:
            out.append((t, r))
    return out


class _RouterTap:
    """Captures router logits of every sparse layer during one forward (forward hooks on `mlp.gate`)."""

    def __init__(self, model):
        self.model, self.handles, self.logits = model, [], {}

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                self.handles.append(gate.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i):
        def hook(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            self.logits[i] = logits.detach().reshape(-1, logits.shape[-1])
        return hook

    def probs(self, layer: int, start: int = 0):
        if layer not in self.logits:
            return None
        return torch.softmax(self.logits[layer].to(torch.float64), dim=-1)[start:].cpu()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
