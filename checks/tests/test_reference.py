"""The oracle is transformers: its rows equal Hugging Face's own model and modules run directly."""
from __future__ import annotations

import contextlib
import copy
import functools
import threading
import warnings

import pytest
import torch

from dpep_parity.checks import units
from dpep_parity.checks.core.batches import Batch, Request, seq_inputs, seq_token_ids
from dpep_parity.checks.oracle.reference import Oracle, _float64_throughout
from dpep_parity.fixtures import families
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.families import sparse_layers
from dpep_parity.fixtures.specs import FIXTURES

ATTN = units.get("attention")

# three DP ranks: an extend request and a request with a cached prefix, an idle rank, a 2+4 request
BATCH = Batch(((Request(0, 5), Request(3, 1)), (), (Request(2, 4),)), seed=11)


@functools.lru_cache(maxsize=None)
def oracle(name: str) -> Oracle:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Oracle(fixture_path(name), "float32")


@functools.lru_cache(maxsize=None)
def hf_model(name: str, dtype: torch.dtype, float64_routers: bool = True):
    """A fresh transformers load, independent of the oracle's cache, with the eager kernels; in float64, the
    modules the family computes in float32 on purpose run in float64 as in the oracle's truth (unless
    `float64_routers` is False: transformers as it ships)."""
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw, path = dict(dtype=dtype, attn_implementation="eager"), str(fixture_path(name))
        try:
            m = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
        except TypeError:
            m = AutoModelForCausalLM.from_pretrained(path, **kw)
    if dtype == torch.float64 and float64_routers:
        _float64_throughout(m)
    return m.eval()


def extend_rows(batch: Batch, per_request: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t[r.prefix:] for (_, _, r), t in zip(batch.requests_flat(), per_request)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def rounding_bound(config, dt: torch.dtype) -> float:
    """How far two computations of the same function in `dt` may drift when they sum in other orders (the
    oracle's one right-padded batch of requests, and its truth's padded-bmm experts, against transformers run
    one request at a time with eager experts): Higham's gamma_n = n u per dot product of length n, n the largest
    fan-in of the fixture, over the GEMMs a token passes in sequence (8 a layer: q/k/v, scores, values, o,
    gate|up, down; one lm head), relative to the output's largest entry. A request attending to another's rows
    moves its rows by O(1) of that scale."""
    c = config
    fan_in = max(c.hidden_size, getattr(c, "intermediate_size", 0) or 0, getattr(c, "moe_intermediate_size", 0) or 0,
                 getattr(c, "shared_expert_intermediate_size", 0) or 0)
    return (8 * c.num_hidden_layers + 1) * fan_in * torch.finfo(dt).eps / 2


def same_rows(got: torch.Tensor, want: torch.Tensor, config) -> bool:
    return got.shape == want.shape and got.dtype == want.dtype and rel(got, want) <= rounding_bound(config, got.dtype)


@pytest.mark.parametrize("name", sorted(FIXTURES))
@torch.no_grad()
def test_model_logits_are_transformers_logits(name):
    o = oracle(name)
    ids = seq_token_ids(BATCH, o.config.vocab_size)
    u = o.model(BATCH, ids)
    rows = sum(r.extend for _, _, r in BATCH.requests_flat())
    assert u.truth.shape == u.ref.shape == (rows, o.config.vocab_size)
    assert (u.truth.dtype, u.ref.dtype) == (torch.float64, torch.float32)
    for dt, got in ((torch.float32, u.ref), (torch.float64, u.truth)):
        m = hf_model(name, dt)
        want = extend_rows(BATCH, [m(input_ids=t[None]).logits[0] for t in ids])
        assert same_rows(got, want, o.config), (name, dt, rel(got, want), rounding_bound(o.config, dt))
    # one device in float32 is ~1e-7 from the float64 truth: the oracle's dtypes are what they claim
    assert 0 < rel(u.ref, u.truth) < 1e-5


@pytest.mark.parametrize("name", ["qwen2-moe-shared", "qwen3-moe-dense"])
@torch.no_grad()
def test_units_equal_the_hf_modules_run_directly(name):
    o = oracle(name)
    H = o.config.hidden_size
    for layer_i in range(o.config.num_hidden_layers):
        seqs = seq_inputs(BATCH, H, torch.float64)
        ua, ud = (units.get(u).reference(o, layer_i, BATCH, seqs) for u in ("attention", "decoder"))
        for dt, a_got, d_got in ((torch.float64, ua.truth, ud.truth), (torch.float32, ua.ref, ud.ref)):
            layer = hf_model(name, dt).model.layers[layer_i]
            rotary = hf_model(name, dt).model.rotary_emb
            a_want, d_want, mlp_in = [], [], []
            hook = layer.mlp.register_forward_pre_hook(lambda mod, args, mlp_in=mlp_in: mlp_in.append(args[0][0]))
            try:
                for (_, _, r), h in zip(BATCH.requests_flat(), seqs):
                    h = h.to(dt)[None]
                    pe = rotary(h, torch.arange(r.total)[None])
                    mask = torch.full((r.total, r.total), torch.finfo(dt).min, dtype=dt).triu(1)[None, None]
                    attn = layer.self_attn(hidden_states=h, position_embeddings=pe, attention_mask=mask)
                    a_want.append(attn[0][0])
                    d_want.append(layer(h, attention_mask=mask, position_embeddings=pe)[0])
            finally:
                hook.remove()
            same = functools.partial(same_rows, config=o.config)
            assert same(a_got, extend_rows(BATCH, a_want)), (name, layer_i, dt)
            assert same(d_got, extend_rows(BATCH, d_want)), (name, layer_i, dt)
            assert ua.router == []
            sparse = sparse_layers(o.config)[layer_i]
            assert len(ud.router) == int(sparse)
            if sparse:     # the decoder's router rows are the extend tokens' (the prefix is not output)
                probs = ud.router[0][0 if dt == torch.float64 else 1]
                gate = layer.mlp.gate.weight
                for p, x, (_, _, r) in zip(probs, mlp_in, BATCH.requests_flat()):
                    want = torch.softmax((x @ gate.T).double(), -1)[r.prefix:]
                    assert p.shape == (r.extend, families.num_experts(o.config))
                    assert torch.allclose(p, want, rtol=0, atol=1e-6 if dt == torch.float32 else 1e-14)
            x = torch.cat([s for s in seqs]).to(dt)
            um = o.mlp(layer_i, x)
            m_got = um.truth if dt == torch.float64 else um.ref
            assert same(m_got, layer.mlp(x[None])[0]), (name, layer_i, dt)
        assert 0 < rel(ud.ref, ud.truth) < 1e-5


def decoder_stack(name: str, dt: torch.dtype, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every decoder layer's output for one request, running transformers' layers one by one."""
    m = hf_model(name, dt)
    n = ids.shape[0]
    x = m.model.embed_tokens(ids[None])
    pe = m.model.rotary_emb(x, torch.arange(n)[None])
    mask = torch.full((n, n), torch.finfo(dt).min, dtype=dt).triu(1)[None, None]
    out = []
    for layer in m.model.layers:
        x = layer(x, attention_mask=mask, position_embeddings=pe)
        out.append(x[0])
    return out


@pytest.mark.parametrize("name", ["qwen2-moe-shared", "qwen3-moe-dense"])
@torch.no_grad()
def test_per_layer_outputs_are_decoder_outputs(name):
    o = oracle(name)
    ids = seq_token_ids(BATCH, o.config.vocab_size)
    u = o.model(BATCH, ids)
    n = o.config.num_hidden_layers
    assert len(u.layers_truth) == len(u.layers_ref) == n
    stacks = [decoder_stack(name, torch.float64, t) for t in ids]
    for i in range(n):      # the last one too: the raw decoder output, not after the final norm
        want = extend_rows(BATCH, [s[i] for s in stacks])
        assert torch.allclose(u.layers_truth[i], want, rtol=0, atol=1e-12), i
        assert 0 < rel(u.layers_ref[i], want) < 1e-5


@torch.no_grad()
def test_attention_is_causal_and_prefix_aware():
    """A request's extend rows depend on its prefix and not on later tokens or other requests."""
    o = oracle("qwen3-moe")
    H = o.config.hidden_size
    one = Batch(((Request(4, 3),),), seed=5)
    seqs = seq_inputs(one, H, torch.float64)
    base = ATTN.reference(o, 0, one, seqs).truth
    later = [seqs[0].clone()]
    later[0][-1] += 1.0                                           # change the last token only
    out = ATTN.reference(o, 0, one, later).truth
    assert torch.equal(out[:2], base[:2]) and not torch.equal(out[2], base[2])
    earlier = [seqs[0].clone()]
    earlier[0][0] += 1.0                                          # change a prefix token
    assert not torch.equal(ATTN.reference(o, 0, one, earlier).truth[0], base[0])


@pytest.mark.parametrize("name", ["qwen3-moe-dense", "qwen2-moe-shared"])
@torch.no_grad()
def test_router_probabilities_for_sparse_layers_only(name):
    o = oracle(name)
    sparse = sparse_layers(o.config)
    ids = seq_token_ids(BATCH, o.config.vocab_size)
    u = o.model(BATCH, ids)
    assert len(u.router) == sum(sparse)
    # independently: softmax of the router weights applied to each sparse layer's MLP input
    m = hf_model(name, torch.float64)
    inputs: dict[int, list[torch.Tensor]] = {}
    hooks = [m.model.layers[i].mlp.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.setdefault(i, []).append(args[0][0])) for i in range(len(sparse))]
    try:
        for t in ids:
            m(input_ids=t[None])
    finally:
        for h in hooks:
            h.remove()
    sparse_ids = [i for i, s in enumerate(sparse) if s]
    for (truth, ref), i in zip(u.router, sparse_ids):
        gate = m.model.layers[i].mlp.gate.weight
        assert len(truth) == len(ref) == len(BATCH.requests_flat())
        for p, p_ref, x, (_, _, r) in zip(truth, ref, inputs[i], BATCH.requests_flat()):
            assert p.shape == p_ref.shape == (r.total, families.num_experts(o.config))    # prefix tokens included
            assert torch.allclose(p, torch.softmax(x @ gate.T, -1), rtol=0, atol=1e-14)
            assert torch.allclose(p.sum(-1), torch.ones(r.total, dtype=torch.float64))
            assert 0 < (p_ref - p).abs().max() < 1e-5
    # unit calls: a dense layer's MLP and attention return no router, a sparse layer's MLP one
    x = torch.randn(6, o.config.hidden_size, dtype=torch.float64)
    for i, s in enumerate(sparse):
        um = o.mlp(i, x)
        assert len(um.router) == int(s)
        if s:
            assert um.router[0][0].shape == (6, families.num_experts(o.config))
    assert ATTN.reference(o, 1, BATCH, seq_inputs(BATCH, o.config.hidden_size, torch.float64)).router == []


@pytest.mark.parametrize("unit", ["attention", "decoder"])
@torch.no_grad()
def test_batched_requests_do_not_see_each_other(unit):
    """The oracle runs every request in one right-padded forward: a request's rows must not move when another
    request's rows change (beyond the rounding of other company), for the truth and the reference; the other's
    rows do move. (Requests packed into one sequence would fail it; pad keys seen by a shorter request's rows,
    or a mask that is not causal, fail test_units_equal_the_hf_modules_run_directly.)"""
    o = oracle("qwen2-moe-shared")
    u = units.get(unit)
    two = Batch(((Request(5, 4),), (Request(1, 2),)), seed=9)
    seqs = seq_inputs(two, o.config.hidden_size, torch.float64)
    base = u.reference(o, 0, two, seqs)
    other = [seqs[0].clone(), seqs[1] + 3.0]                      # the second request's rows only
    moved = u.reference(o, 0, two, other)
    first = two.requests_flat()[0][2].extend
    for got, want in ((moved.truth, base.truth), (moved.ref, base.ref)):
        assert same_rows(got[:first], want[:first], o.config)
        assert rel(got[first:], want[first:]) > 1e-3


@torch.no_grad()
def test_truth_runs_float32_routers_in_float64():
    """GLM's router casts to float32 in transformers whatever the model's dtype: shipped as it is, a float64
    model's routing weights carry float32 rounding (a float32 test's error would sit at the truth's own); the
    truth runs the same forward code with its casts read as float64. Control: Qwen (no such module) is
    transformers' float64 model unchanged."""
    x = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    shipped = hf_model("glm4-moe", torch.float64, float64_routers=False).model.layers[1].mlp.gate
    truth = oracle("glm4-moe").truth_model.model.layers[1].mlp.gate
    (l32, _, _), (l64, w64, i64) = shipped(x), truth(x)
    assert (l32.dtype, l64.dtype) == (torch.float32, torch.float64)
    want = torch.nn.functional.linear(x, truth.weight.double())
    assert torch.allclose(l64, want, rtol=1e-14, atol=1e-14) and not torch.allclose(l32.double(), want, rtol=1e-12)
    chosen = torch.sigmoid(want).gather(1, i64)
    assert torch.allclose(w64, chosen / chosen.sum(-1, keepdim=True) * truth.routed_scaling_factor, rtol=1e-13)
    qwen = oracle("qwen3-moe").truth_model.model.layers[0].mlp.gate
    assert "forward" not in vars(qwen)


@torch.no_grad()
def test_truth_runs_tensor_float_casts_in_float64():
    """MiniMax-M2's router writes its float32 cast as `router_logits.float()`: the truth reads that as float64
    too, and only inside the router (a float32 tensor made elsewhere stays float32). The correction bias the
    block hands its router is the checkpoint's (transformers renames MiniMax's names on load)."""
    x = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    block = oracle("minimax-m2").truth_model.model.layers[0].mlp
    shipped = hf_model("minimax-m2", torch.float64, float64_routers=False).model.layers[0].mlp
    bias = block.e_score_correction_bias
    assert bias.abs().max() > 0 and torch.equal(bias, shipped.e_score_correction_bias)
    (_, w32, _), (logits, w64, i64) = shipped.gate(x, bias), block.gate(x, bias)
    assert (w32.dtype, w64.dtype) == (torch.float32, torch.float64)
    chosen = torch.sigmoid(logits).gather(1, i64)
    assert torch.allclose(w64, chosen / chosen.sum(-1, keepdim=True), rtol=1e-14, atol=0)
    assert not torch.allclose(w32.double(), w64, rtol=1e-12, atol=0)
    assert torch.ones(2).float().dtype == torch.float32


def _answers(o: Oracle, unit: str, batch: Batch):
    u = units.get(unit)
    inputs = u.global_inputs(batch, o.config.to_dict(), o.dtype)
    return o.answer(lambda: u.reference(o, 0, batch, inputs), lambda: u.decoys(o, 0, batch, inputs))


@contextlib.contextmanager
def _forward_threads(o: Oracle):
    """{"truth" | "reference" | "decoys": the threads that ran a forward of any module of that model} while inside."""
    seen: dict[str, set] = {"truth": set(), "reference": set(), "decoys": set()}
    models = {"truth": o.truth_model, "reference": o.ref_model}
    if o.decoy_model is not o.ref_model:
        models["decoys"] = o.decoy_model
    else:                               # one object: its forwards count as both
        seen["decoys"] = seen["reference"]
    hooks = [m.register_forward_pre_hook(lambda mod, args, _s=seen[name]: _s.add(threading.get_ident()))
             for name, model in models.items() for m in model.modules()]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _flat(answer) -> list[torch.Tensor]:
    uref, variants = answer
    router = [p for t, r in uref.router for p in (*t, *r)]
    return [uref.truth, uref.ref, *router, *uref.layers_truth, *uref.layers_ref, *variants]


@pytest.mark.parametrize("unit", ["moe", "decoder", "model"])
def test_threaded_oracle_answers_as_one_thread(unit):
    """`Oracle.answer` with `threaded` (the truth and the reference in a worker thread while this thread computes
    the decoys on a model copy of their own: the default on CUDA) answers bit for bit as one thread does: truth,
    reference, router probabilities, per-layer outputs and decoys, for rows, right-padded requests and a whole
    model; the truth's and the reference's forwards ran in the worker only, the decoys' in this thread only (forward
    pre-hooks on every module). Controls: the comparison fails where the worker's reference ran with other experts
    (sharing one model object between the threads let that happen: `experts_as` switches a model object's experts,
    and on CUDA the decoys' add a token's expert outputs in the dtype; on the CPU both add them so, batched_mm in
    float32); the thread check fails where the decoys share the reference's model object."""
    from dpep_parity.checks.oracle.reference import experts_as
    path = str(fixture_path("qwen3-moe"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one, two = Oracle(path, "bfloat16"), Oracle(path, "bfloat16", threaded=True)
    assert not one.threaded and one.decoy_model is one.ref_model            # on the CPU: one thread by default
    assert two.threaded and two.decoy_model is not two.ref_model
    batch = Batch(((Request(0, 5), Request(3, 2)), (Request(2, 4),)), seed=17)
    want = _flat(_answers(one, unit, batch))
    with _forward_threads(two) as seen:
        got = _flat(_answers(two, unit, batch))
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    # the truth and the reference ran in the worker only, the decoys in this thread only (a shared model object,
    # the control below, runs the reference model in both)
    assert seen["truth"] and seen["reference"] and seen["decoys"]
    assert threading.get_ident() not in seen["truth"] | seen["reference"] and seen["decoys"] == {threading.get_ident()}
    shared = copy.copy(two)
    shared.decoy_model = shared.ref_model
    with _forward_threads(shared) as seen, contextlib.suppress(RuntimeError):
        _answers(shared, unit, batch)      # may raise: the threads' router taps on one model can cross (the race)
    assert threading.get_ident() in seen["reference"], "control: a shared model runs in both threads"
    if unit == "moe":
        with experts_as(two.ref_model, "batched_mm"):
            raced = _flat(_answers(two, unit, batch))
        assert not torch.equal(raced[1], want[1]), "control: the reference with other experts differs"


def test_threaded_oracle_waits_for_its_worker_when_the_decoys_fail():
    """An error in the decoys reaches the caller, raised only after the worker's truth and reference are done
    (nothing of the oracle is still in use when the caller sees the error)."""
    import time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = Oracle(str(fixture_path("qwen3-moe")), "bfloat16", threaded=True)
    done = threading.Event()

    def slow_reference():
        time.sleep(0.3)
        done.set()

    def failing_decoys():
        raise RuntimeError("decoys failed")
    with pytest.raises(RuntimeError, match="decoys failed"):
        o.answer(slow_reference, failing_decoys)
    assert done.is_set() and o._open == 0


def test_tensor_float_reads_float64_in_its_own_thread_only():
    """The truth's `Tensor.float()` as float64 (`_tensor_float_is_float64`, MiniMax-M2's router) holds in the thread
    that entered it: the decoys, computed in the other thread meanwhile, keep float32; torch's own method is back
    after the last thread leaves. Control: the patch as it was (process-wide) is seen by the other thread."""
    from dpep_parity.checks.oracle.reference import _tensor_float_is_float64

    @contextlib.contextmanager
    def process_wide():        # the negative control: the patch before the oracle had a worker thread
        before = torch.Tensor.float
        torch.Tensor.float = lambda self, *a, **kw: self.to(torch.float64)
        try:
            yield
        finally:
            torch.Tensor.float = before

    def truth(patch, inside, go, seen):      # the worker: inside the patch until told to leave
        with patch():
            seen.append(torch.ones(1).float().dtype)
            inside.set()
            go.wait(10)

    own = torch.Tensor.float
    for patch, leaks in ((_tensor_float_is_float64, False), (process_wide, True)):
        inside, go, seen = threading.Event(), threading.Event(), []
        t = threading.Thread(target=truth, args=(patch, inside, go, seen))
        t.start()
        assert inside.wait(10)
        other = torch.ones(1).float().dtype        # this thread, while the other is inside
        go.set()
        t.join(10)
        assert seen == [torch.float64]
        assert (other == torch.float64) == leaks, patch.__name__
        assert torch.Tensor.float is own


def test_threaded_oracle_waits_for_its_worker_through_an_interrupt(monkeypatch):
    """An interrupt while the caller waits for the worker (Ctrl-C in a long truth) is raised only after the worker
    is done: the wait is taken up again, then the interrupt goes on (`_until_done`)."""
    import time

    from dpep_parity.checks.oracle import reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = Oracle(str(fixture_path("qwen3-moe")), "bfloat16", threaded=True)
    done, waits, real = threading.Event(), [], reference.futures_wait

    def interrupted_wait(fs):      # the first wait is interrupted, as a SIGINT in the waiting thread would be
        waits.append(1)
        if len(waits) == 1:
            raise KeyboardInterrupt
        return real(fs)

    def slow_reference():
        time.sleep(0.3)
        done.set()
    monkeypatch.setattr(reference, "futures_wait", interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        o.answer(slow_reference, list)
    assert done.is_set() and len(waits) >= 2 and o._open == 0


def test_profiled_times_the_oracles_phases_and_always_ends():
    """`profiled()` (checks.tools.bench_gpu's per-example times): inside, an oracle call's phases and the host's time
    to queue them land in the dict it yields; outside, nothing is timed, also after the body raised."""
    from dpep_parity.checks.oracle import reference
    o = oracle("qwen3-moe")
    x = torch.randn(3, o.config.hidden_size)
    with reference.profiled() as prof:
        o.mlp(1, x)
    assert {"truth", "reference", "queued"} <= prof.keys() and all(v > 0 for v in prof.values())
    assert reference.PROFILE is None
    with pytest.raises(RuntimeError, match="inside"), reference.profiled():
        raise RuntimeError("inside")
    assert reference.PROFILE is None
    o.mlp(1, x)                          # outside: the dict of the last block is not written again
    assert reference.PROFILE is None


def test_decoy_copies_are_cached_apart_from_the_oracles_models():
    """A threaded oracle's decoy model is a copy of the reference, loaded once and kept in a cache of its own: the
    truth and reference models of unthreaded sessions keep their cache (8 models) to themselves."""
    from dpep_parity.checks.oracle import reference
    path = str(fixture_path("qwen3-moe"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = Oracle(path, "bfloat16", threaded=True), Oracle(path, "bfloat16", threaded=True)
    assert a.decoy_model is b.decoy_model and a.decoy_model is not a.ref_model and a.ref_model is b.ref_model
    main = reference._load.cache_info()
    copies = reference._load_copy.cache_info()
    assert main.maxsize == 8 and copies.currsize >= 1
    reference.load_model(path, "bfloat16", "cpu", "eager", "decoys")      # the copy's key: the reference's experts
    assert reference._load.cache_info() == main       # a copy never touches the main cache
