"""The single-device oracle: Hugging Face transformers' own modules of the fixture's family (Qwen2-MoE,
Qwen3-MoE, GLM-4.5-MoE: fixtures.families), code that no engine under test shares. Loaded from the fixture directory (never cast in memory: transformers keeps the
rotary inv_freq in fp32 on load) in float64 for the truth and in the test dtype for the reference.

Devices: the reference (test dtype) runs on the device of the system under test, so that its rounding is
the rounding of the same kernels (cuBLAS on CUDA, which may reduce bf16 GEMMs in another order than the
CPU does); the float64 truth may run anywhere (`truth_device`, default: the same device). Inputs are CPU
tensors; every tensor a UnitRef holds is back on the CPU.

Experts (checks.oracle.oracle_experts, through transformers' `experts_implementation` switch): the truth's float64
experts run as two padded batched GEMMs (`dpep_padded_bmm`), the reference's through transformers'
`grouped_mm` on CUDA and its eager loop on CPU; the decoy variants' add a token's expert outputs in the dtype
where the reference adds them in float32 (`oracle_experts.decoy_experts`). Every request of an example runs in
one right-padded forward (`per_request`, `model`).

Rows are the extend tokens of every request, in global order (DP rank, then request, then position).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from dpep_parity.checks.core.batches import DTYPES, Batch
from dpep_parity.checks.harness import gpus
from dpep_parity.checks.oracle import oracle_experts
from dpep_parity.fixtures import families


@dataclass
class UnitRef:
    truth: torch.Tensor                      # [rows, cols] float64
    ref: torch.Tensor                        # [rows, cols] in dtype
    # per sparse layer: router probabilities of every row (truth, ref), for near-tie detection
    router: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    layers_truth: list[torch.Tensor] = field(default_factory=list)   # model: per-layer outputs (rows)
    layers_ref: list[torch.Tensor] = field(default_factory=list)


# Seconds per oracle phase ("truth", "reference", "variants"; "queued": the host's time in an outermost `settling`
# before it waits for the device) while checks.tools.bench_gpu sets a dict here; None
# (the default) costs nothing. On CUDA a phase is timed by CUDA events on its device's stream (the GPU's time from
# the phase's first queued kernel to its last), settled when the Oracle's call returns: synchronizing at every
# phase boundary would stop the next phase's kernels being queued while the last one's run, which is what is timed.
PROFILE: dict[str, float] | None = None
# Oracle's `threaded` default where both models are on CUDA: None reads DPEP_ORACLE_THREAD
# (checks.harness.gpus.oracle_thread); checks.tools.bench_gpu sets True or False for its before / after
THREADED: bool | None = None
_PENDING: list = []     # (name, start event, end event) of CUDA phases not yet settled


@contextlib.contextmanager
def phase(name: str, device):
    if PROFILE is None:
        yield
        return
    device = torch.device(device)
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            _PENDING.append((name, start, end))
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        PROFILE[name] = PROFILE.get(name, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def profiled():
    """PROFILE is a fresh dict inside (the one yielded) and None again on the way out, however it is left:
    `checks.tools.bench_gpu`'s per-example phase times. Its CUDA phases are in the dict once the oracle's call
    inside has returned (settled)."""
    global PROFILE
    _PENDING.clear()          # events of a block whose device synchronization raised (`settling` drains the rest)
    PROFILE = prof = {}
    try:
        yield prof
    finally:
        PROFILE = None


def _settle_profile() -> None:
    """The CUDA phases' times into PROFILE (their events have completed: called after a synchronization)."""
    while _PENDING:
        name, start, end = _PENDING.pop(0)
        end.synchronize()
        if PROFILE is not None:
            PROFILE[name] = PROFILE.get(name, 0.0) + start.elapsed_time(end) / 1e3


def _timed(name: str):
    def deco(fn):
        @functools.wraps(fn)
        def timed(self, *a, **kw):
            with phase(name, _dev(self.ref_model)):
                return fn(self, *a, **kw)
        return timed
    return deco


def _settled(fn):
    """An Oracle method whose results are on the CPU when it returns (`Oracle.settling`: when it is the outermost
    such call)."""
    @functools.wraps(fn)
    def settled(self, *a, **kw):
        with self.settling():
            return fn(self, *a, **kw)
    return settled


@functools.lru_cache(maxsize=None)
def _side_stream(device: str, role: str):
    """A CUDA stream of the oracle's own per device and role: "truth", the float64 truth's
    (`Oracle._on_truth_stream`); "worker", the worker thread's (`Oracle.answer`). `role` has no default: the cache
    keys on the arguments as written, so a defaulted call and an explicit one would be two streams for one role."""
    return torch.cuda.Stream(device=torch.device(device))


@functools.lru_cache(maxsize=None)
def _worker(device: str) -> ThreadPoolExecutor:
    """The thread that queues the truth and the reference while the calling thread queues the decoys
    (`Oracle.answer`), one per device; idle between examples."""
    return ThreadPoolExecutor(1, thread_name_prefix=f"dpep-oracle-{device}")


def _until_done(fut) -> None:
    """Wait for the worker's future, also through an interrupt while waiting (re-raised once it is done): the
    oracle's models and its settlement must not be left to a worker still running."""
    pending = None
    while not fut.done():
        try:
            futures_wait([fut])
        except BaseException as e:      # noqa: BLE001 -- re-raised below, after the worker is done
            pending = e
    if pending is not None:
        raise pending


def _to_host(x: torch.Tensor) -> torch.Tensor:
    """`x` on the CPU; from CUDA a copy queued behind the kernels that make `x`, into pinned memory, that the
    CPU may read only after the device's synchronization (`_settled`)."""
    return x.to("cpu", non_blocking=True) if x.is_cuda else x


def _to_device(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`x` (CPU) on `dev`; to CUDA through pinned memory, queued without waiting for the kernels before it (a
    copy from pageable memory synchronizes the stream first). torch's pinned-memory cache keeps the staging
    buffer until the copy has run."""
    return x.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else x.to(dev)


def load_model(model_dir: str, dtype: str, device: str = "cpu", experts: str = "eager", instance: str = ""):
    """transformers' model from the fixture folder in `dtype` on `device`, its experts through transformers'
    `experts_implementation` switch (checks.oracle.oracle_experts: eager, grouped_mm, batched_mm, dpep_padded_bmm).
    `instance`: another copy of the same model (the decoys' own, `Oracle.threaded`: a module's forward hooks and its
    experts switch are per object, and the reference's and the decoys' forwards may run at once). The copies have
    a cache of their own, so that an unthreaded session keeps the models it kept before the copies existed."""
    if instance:
        return _load_copy(model_dir, dtype, device, experts, instance)
    return _load(model_dir, dtype, device, experts)


@functools.lru_cache(maxsize=8)    # four oracles: their truth and reference
def _load(model_dir: str, dtype: str, device: str, experts: str):
    return _from_pretrained(model_dir, dtype, device, experts)


@functools.lru_cache(maxsize=4)    # the decoys' copies of four threaded oracles (`Oracle.threaded`)
def _load_copy(model_dir: str, dtype: str, device: str, experts: str, instance: str):
    return _from_pretrained(model_dir, dtype, device, experts)


def _from_pretrained(model_dir: str, dtype: str, device: str, experts: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    kw = dict(dtype=DTYPES[dtype], attn_implementation="eager")
    if not oracle_experts.register():   # transformers 4.x has no experts_implementation: eager experts
        m = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    else:
        m = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=experts, **kw)
    if device != "cpu":
        m = m.to(device)   # moves storage only: the fp32 rotary inv_freq stays fp32
    if dtype == "float64":
        _float64_throughout(m)
    return m.eval()


class _Float64Torch:
    """`torch` as a module whose `float32` is float64: the globals under which a module's own forward runs in
    the truth, so that a cast to float32 written on purpose (transformers computes GLM's and DeepSeek-V3's
    routers in float32 whatever the model's dtype) keeps float64 there."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


_FLOAT_PATCH = threading.local()      # .on: this thread's Tensor.float() returns float64 (`_tensor_float_is_float64`)
_FLOAT_PATCH_LOCK = threading.Lock()
_FLOAT_PATCH_USERS = [0, None]        # threads inside, torch's own Tensor.float while patched


@contextlib.contextmanager
def _tensor_float_is_float64():
    """`Tensor.float()` returns float64 inside, in this thread only: MiniMax-M2's router writes its float32 cast
    as a tensor method (`sigmoid(router_logits.float())`), which no module global redirects. Only the truth's
    router forward runs under it; the reference and the decoys may run at once in another thread
    (`Oracle.threaded`), where `.float()` stays float32. Installed while any thread is inside; restored after."""
    with _FLOAT_PATCH_LOCK:
        if not _FLOAT_PATCH_USERS[0]:
            own = _FLOAT_PATCH_USERS[1] = torch.Tensor.float

            def patched(self, *a, _own=own, **kw):
                return self.to(torch.float64) if getattr(_FLOAT_PATCH, "on", False) else _own(self, *a, **kw)
            torch.Tensor.float = patched
        _FLOAT_PATCH_USERS[0] += 1
    was, _FLOAT_PATCH.on = getattr(_FLOAT_PATCH, "on", False), True
    try:
        yield
    finally:
        _FLOAT_PATCH.on = was
        with _FLOAT_PATCH_LOCK:
            _FLOAT_PATCH_USERS[0] -= 1
            if not _FLOAT_PATCH_USERS[0]:
                torch.Tensor.float = _FLOAT_PATCH_USERS[1]


def _float64_throughout(model) -> None:
    """The float64 truth runs the modules its family names (fixtures.families: `float32_modules`) with their
    own forward code, its float32 casts (`torch.float32`, `Tensor.float()`) read as float64: the truth must
    not round where the reference keeps float32 (it would be no truth for a float32 test)."""
    import types

    names = set(families.get(model.config).float32_modules)
    for mod in model.modules():
        if type(mod).__name__ in names:
            fn = type(mod).forward
            code = types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()}, fn.__name__,
                                      fn.__defaults__, fn.__closure__)

            def forward(self, *args, _code=code, **kwargs):
                with _tensor_float_is_float64():
                    return _code(self, *args, **kwargs)
            mod.forward = types.MethodType(forward, mod)


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
    `truth_device`: where the float64 truth runs (default: `device`); `truth_stream`: on CUDA, the truth on a
    stream of its own, beside the reference and the decoys (False: on the current stream, in line with them);
    `threaded`: `answer` computes the truth and the reference in a worker thread while the calling thread computes
    the decoys, on a model copy of their own (default: where both models are on CUDA, THREADED, or else
    DPEP_ORACLE_THREAD; on the CPU, where the cores are the oracle's already, only when asked)."""

    def __init__(self, model_dir: str, dtype: str, device: str = "cpu", truth_device: str | None = None,
                 truth_stream: bool = True, threaded: bool | None = None):
        self.dir, self.dtype_name = str(model_dir), dtype
        self.dtype = DTYPES[dtype]
        self.device = resolve_device(device)
        self.truth_device = resolve_device(truth_device) if truth_device else self.device
        self.truth_model = load_model(self.dir, "float64", self.truth_device, oracle_experts.truth_experts())
        ref_experts = oracle_experts.reference_experts(self.dtype, self.device)
        self.ref_model = load_model(self.dir, dtype, self.device, ref_experts)
        self.decoy_experts = oracle_experts.decoy_experts(ref_experts)
        self.config = self.truth_model.config
        dev = _dev(self.truth_model)
        self.truth_stream = _side_stream(str(dev), "truth") if truth_stream and dev.type == "cuda" else None
        if threaded is None:
            on_cuda = dev.type == "cuda" and _dev(self.ref_model).type == "cuda"
            threaded = on_cuda and (gpus.oracle_thread() if THREADED is None else THREADED)
        self.threaded = threaded
        self.decoy_model = load_model(self.dir, dtype, self.device, ref_experts, "decoys") if self.threaded \
            else self.ref_model
        self._open = 0
        self._open_lock = threading.Lock()      # `settling` is entered from the worker thread too

    @contextlib.contextmanager
    def settling(self):
        """Calls of this oracle inside are settled once, on the way out: every tensor they returned is on the CPU
        and complete after it, not before. Inside, copies to and from a CUDA device are queued without waiting
        (`_to_device`, `_to_host`), so that the CPU queues a forward's kernels while the last one's still run
        (a copy that waited, a pageable copy or `.cpu()`, drained the GPU at every request, phase and router tap),
        and the truth's kernels on its own stream run beside the reference's and the decoys' (`_on_truth_stream`).
        Nothing inside may read the values of what an inner call returned (views, splits and lists are fine)."""
        with self._open_lock:
            self._open += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._open_lock:
                self._open -= 1
                last = not self._open
            if last:
                if PROFILE is not None:     # the host's time to queue everything, before waiting for the GPU
                    PROFILE["queued"] = PROFILE.get("queued", 0.0) + time.perf_counter() - t0
                for dev in {_dev(self.truth_model), _dev(self.ref_model)}:
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)       # every stream of the device: the truth's too
                _settle_profile()

    def answer(self, reference, decoys):
        """(reference(), decoys()): a unit's truth and reference, and its decoy variants, settled together (one
        synchronization). With `threaded`, reference() runs in a worker thread, on a CUDA stream of its own (the
        truth's on the truth stream), while this thread queues decoys() on the decoy model: the host queues the
        two at once (torch releases the GIL while it dispatches an operator) and the GPU runs them beside each
        other. The worker's stream first waits for this one's work queued so far (weights, inputs)."""
        with self.settling():
            if not self.threaded:
                return reference(), decoys()
            dev = _dev(self.ref_model)
            stream = _side_stream(str(dev), "worker") if dev.type == "cuda" else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(dev))

            def work():
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    return reference()
            fut = _worker(str(dev)).submit(work)
            try:
                variants = decoys()
            finally:
                _until_done(fut)     # on any way out (a decoy error, an interrupt) the worker is done first
            return fut.result(), variants

    @contextlib.contextmanager
    def _on_truth_stream(self, model):
        """The truth's forwards on a CUDA stream of their own (`truth_stream`), so that its float64 GEMMs (memory
        bound: every expert's weights in float64, milliseconds of GPU time) run while the CPU queues the reference
        and the decoys on the device's current stream and the GPU runs them beside, instead of after. The truth
        stream first waits for everything queued before it on the current one (weights, inputs); every tensor
        the truth makes stays on its stream until `settling` synchronizes the device. Other models: unchanged."""
        s = self.truth_stream if model is self.truth_model else None
        if s is None:
            yield
            return
        s.wait_stream(torch.cuda.current_stream(s.device))
        with torch.cuda.stream(s):
            yield

    def _both(self):
        """(model, dtype) of the truth, then of the reference; each loop body is timed as its phase (PROFILE), the
        truth's on its stream (`_on_truth_stream`)."""
        for model, dt, name in ((self.truth_model, torch.float64, "truth"), (self.ref_model, self.dtype, "reference")):
            with self._on_truth_stream(model), phase(name, _dev(model)):
                yield model, dt

    @torch.no_grad()
    @_settled
    def mlp(self, layer: int, x: torch.Tensor) -> UnitRef:
        """The layer's MLP block (sparse MoE or dense) on rows x [rows, hidden]."""
        outs, probs = [], []
        for model, dt in self._both():
            block = model.model.layers[layer].mlp
            with _RouterTap(model) as tap:
                outs.append(_to_host(_hidden(block(_to_device(x.to(dt), _dev(model))[None])).reshape(x.shape[0], -1)))
            probs.append(tap.probs(layer))
        return UnitRef(outs[0], outs[1], [tuple(probs)] if probs[0] is not None else [])

    @torch.no_grad()
    @_settled
    def per_request(self, batch: Batch, seqs: list[torch.Tensor], fn, layers: list[int]) -> UnitRef:
        """`fn(model, h, position_embeddings, mask)` on the requests' sequences (prefix + extend); the extend rows,
        and the router probabilities of `layers` (the sparse ones among them).

        Every request runs in one forward, right-padded to the longest: under the causal mask a real row attends
        only to its own request's earlier rows (pad keys come after every real query), and every other op is
        row-wise, so each real row is the same function as alone. In float64 that is the truth up to float64
        rounding; in the test dtype it is one device serving the batch (its rounding depends on the company, as
        a serving engine's does: the decoy variants sample other company)."""
        with self._on_truth_stream(self.truth_model), phase("truth", _dev(self.truth_model)):
            truth = self._padded_requests(self.truth_model, torch.float64, batch, seqs, fn, layers)
        with phase("reference", _dev(self.ref_model)):
            ref = self._padded_requests(self.ref_model, self.dtype, batch, seqs, fn, layers)
        router = _merge_router(truth[1], ref[1], len(layers))
        return UnitRef(truth[0], ref[0], router)

    def _padded_requests(self, model, dt, batch: Batch, seqs, fn, layers, extra: list[torch.Tensor] = ()):
        """`fn` on every request of `batch` (and the `extra` sequences after them) in one right-padded forward:
        the requests' extend rows, and per request the router probabilities of `layers` over its own tokens."""
        reqs = [req for _, _, req in batch.requests_flat()]
        if not reqs:
            return _cat([], self.config.hidden_size, dt), []
        dev = _dev(model)
        h = _to_device(pad_sequence([t.to(dt) for t in [*seqs, *extra]], batch_first=True), dev)   # zeros after each
        longest = h.shape[1]
        pos = torch.arange(longest, device=dev)[None].expand(h.shape[0], -1)
        pe = model.model.rotary_emb(h, pos)
        with _RouterTap(model) as tap:
            out = fn(model, h, pe, _causal_mask(longest, dt, dev))
        rows = _gather_rows(out, [(b, r.prefix, r.total) for b, r in enumerate(reqs)])
        taps = _per_request([tap.spans(i, [(b * longest + r.prefix, b * longest + r.total)
                                           for b, r in enumerate(reqs)]) for i in layers], len(reqs))
        return rows, taps

    @torch.no_grad()
    @_settled
    def model(self, batch: Batch, token_ids: list[torch.Tensor]) -> UnitRef:
        """Logits of every extend token, per-layer hidden states, and router probabilities of every token
        (prefix tokens included: a tie in the prefix changes the cache the extend tokens attend to). Every
        request in one right-padded forward, as in `per_request`."""
        res = []
        ids = pad_sequence(token_ids, batch_first=True) if token_ids else None
        for model, dt in self._both():
            res.append(self._model_calls(model, dt, batch, ids))
        n_layers = self.config.num_hidden_layers
        router = _merge_router(res[0][2], res[1][2], n_layers)
        return UnitRef(res[0][0], res[1][0], router, res[0][1], res[1][1])

    def _model_calls(self, model, dt, batch: Batch, ids: torch.Tensor | None):
        """One forward of the requests' right-padded token ids [B, S] (their rows first, any others after; None:
        no request) -> logits and per-layer hidden states of the extend tokens, router probabilities of every
        token of each request."""
        n_layers = self.config.num_hidden_layers
        reqs = [req for _, _, req in batch.requests_flat()]
        if ids is None or not reqs:
            v, hs = self.config.vocab_size, self.config.hidden_size
            return _cat([], v, dt), [_cat([], hs, dt) for _ in range(n_layers)], []
        outs: dict[int, torch.Tensor] = {}
        hooks = [layer.register_forward_hook(_keep_output(outs, i)) for i, layer in enumerate(model.model.layers)]
        try:   # hooks, not output_hidden_states: its last entry is after the final norm
            with _RouterTap(model) as tap:
                out = model(input_ids=_to_device(ids, _dev(model)))
        finally:
            for h in hooks:
                h.remove()
        width = ids.shape[1]
        extend = [(b, r.prefix, r.total) for b, r in enumerate(reqs)]
        taps = _per_request([tap.spans(i, [(b * width, b * width + r.total) for b, r in enumerate(reqs)])
                             for i in range(n_layers)], len(reqs))
        return _gather_rows(out.logits, extend), [_gather_rows(outs[i], extend) for i in range(n_layers)], taps

    # The reference in the test dtype again, with the same rows computed among decoy rows or decoy requests:
    # GEMM blocking depends on the batch, so one token's rounding differs with its company (measured: a
    # qwen3-moe MoE row's fp32 error went from 1.3e-7 alone to 5.9e-7 among 8 rows). Together with the plain
    # reference these sample the error one device legitimately makes. Each unit picks its kind (checks.units).
    # The evaluations among decoys (the 7-row one for the MoE block) also take the other legitimate habit of
    # adding a token's expert outputs (`self.decoy_experts`: in the dtype where the reference adds in float32).
    # Decoy rows are drawn in float32, as the inputs are (checks.core.batches.seq_inputs): a float64 draw and its
    # conversion took a quarter of the decoder's oracle host time on the H100 (docs/gpu.md, fifth pass); on 2 cores
    # 2.42 -> 0.42 ms for 2 x 40 x 2048 drawn and rounded to bfloat16.
    def _decoy_experts(self):
        return experts_as(self.decoy_model, self.decoy_experts)

    @torch.no_grad()
    @_settled
    @_timed("variants")
    def decoy_rows(self, layer: int, batch: Batch, x: torch.Tensor) -> list[torch.Tensor]:
        """The layer's MLP block on rows x among 1 and among 7 random decoy rows."""
        model, dt = self.decoy_model, self.dtype
        g = torch.Generator().manual_seed(batch.seed + 1)
        block = model.model.layers[layer].mlp
        out = []
        for extra in (1, 7):
            decoys = torch.randn(extra, x.shape[1], generator=g, dtype=torch.float32).to(dt)   # as seq_inputs
            with self._decoy_experts() if extra == 7 else contextlib.nullcontext():
                out.append(_to_host(_hidden(block(_to_device(torch.cat([x.to(dt), decoys]), _dev(model))[None]))
                                    [0, : x.shape[0]]))
        return out

    @torch.no_grad()
    @_settled
    @_timed("variants")
    def decoy_sequences(self, batch: Batch, seqs: list[torch.Tensor], fn) -> list[torch.Tensor]:
        """`fn` (as for per_request) on all requests batched with two random decoy sequences of the longest's
        length: other company for every row, one forward."""
        g = torch.Generator().manual_seed(batch.seed + 1)
        longest = max([s.shape[0] for s in seqs] + [1])
        decoys = list(torch.randn(2, longest, self.config.hidden_size, generator=g, dtype=torch.float32))
        with self._decoy_experts():
            rows, _ = self._padded_requests(self.decoy_model, self.dtype, batch, seqs, fn, [], extra=decoys)
        return [rows]

    @torch.no_grad()
    @_settled
    @_timed("variants")
    def decoy_tokens(self, batch: Batch, token_ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model's logits of all requests batched with two random decoy requests of the longest's length."""
        g = torch.Generator().manual_seed(batch.seed + 1)
        longest = max([t.shape[0] for t in token_ids] + [1])
        decoys = list(torch.randint(0, self.config.vocab_size, (2, longest), generator=g))
        ids = pad_sequence([*token_ids, *decoys], batch_first=True) if token_ids else None
        with self._decoy_experts():
            logits, _, _ = self._model_calls(self.decoy_model, self.dtype, batch, ids)
        return [logits]


@contextlib.contextmanager
def experts_as(model, experts: str | None):
    """`model`'s experts through transformers' implementation `experts` inside the block (None: unchanged)."""
    before = model.config._experts_implementation
    if experts is None or experts == before:
        yield
        return
    model.set_experts_implementation(experts)
    try:
        yield
    finally:
        model.set_experts_implementation(before)


def _hidden(out):
    """A block's hidden states: GPT-OSS's MLP returns (hidden states, router scores)."""
    return out[0] if isinstance(out, tuple) else out


def layer_mask(model, layer: int, mask: torch.Tensor) -> torch.Tensor:
    """The attention mask transformers' model hands layer `layer`: `mask` (causal over right-padded requests)
    with the sliding window on the layers whose `layer_types` entry is sliding_attention (GPT-OSS). transformers'
    eager attention enforces the window only through this mask, which its model builds per layer type
    (`create_sliding_window_causal_mask`: key k visible from query q when q - window < k <= q); a unit that calls
    a layer directly must build it as the model would."""
    types, window = getattr(model.config, "layer_types", None), getattr(model.config, "sliding_window", None)
    if not types or not window or types[layer] != "sliding_attention":
        return mask
    n = mask.shape[-1]
    pos = torch.arange(n, device=mask.device)
    outside = pos[None, :] <= pos[:, None] - window
    return mask.masked_fill(outside, torch.finfo(mask.dtype).min)


def _keep_output(store: dict, i: int):
    def hook(mod, inp, out):
        store[i] = (out[0] if isinstance(out, tuple) else out).detach()
    return hook


def _gather_rows(out: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Rows start:stop of sequence b of `out` [B, S, cols], for each (b, start, stop) in order, concatenated on the
    CPU: one gather and one copy off the device, queued (`_to_host`; a copy per request cost a synchronisation
    each: docs/gpu.md)."""
    width = out.shape[1]
    idx = [b * width + p for b, start, stop in spans for p in range(start, stop)]
    flat = out.reshape(-1, out.shape[-1])
    return _to_host(flat[_to_device(torch.tensor(idx, dtype=torch.long), flat.device)])


def _per_request(per_layer: list[list], n: int) -> list[list]:
    """[layer][request] -> [request][layer]."""
    return [[layer[q] for layer in per_layer] for q in range(n)]


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
    """Captures the router's choice scores of every sparse layer during one forward (forward hooks on the block's
    router, `mlp.gate` or as the family names it:
    its logits, turned into the scores whose top-k is the choice by the model's family). `probs` hands them out
    as a softmax over the scores: for a softmax router the router's probabilities, for a sigmoid router with a
    correction bias a distribution whose log-ratios are the score margins (what the near-tie test reads)."""

    def __init__(self, model):
        self.model, self.handles, self.logits = model, [], {}
        self.choice = families.get(model.config).choice_scores

    def __enter__(self):
        router = families.get(self.model.config).router
        for i, layer in enumerate(self.model.model.layers):
            gate = getattr(layer.mlp, router, None)
            if gate is not None and hasattr(gate, "top_k"):
                self.handles.append(gate.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i):
        def hook(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            self.logits[i] = self.choice(mod, logits.detach().reshape(-1, logits.shape[-1]), inp)
        return hook

    def probs(self, layer: int):
        if layer not in self.logits:
            return None
        return _to_host(torch.softmax(self.logits[layer], dim=-1))

    def spans(self, layer: int, spans: list[tuple[int, int]]) -> list:
        """Rows start:stop of `probs(layer)` for each (start, stop) (None each for a layer without a router): one
        softmax and one copy off the device per layer, the softmax being per row."""
        whole = self.probs(layer)
        return [None if whole is None else whole[start:stop] for start, stop in spans]

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
