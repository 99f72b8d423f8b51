"""The GPU tier: layer parity at production shapes (fixtures.large), on CUDA.

The MoE block and the decoder layer of Qwen3-30B-A3B (128 experts, top-8) and of Qwen2-57B-A14B's
shared-expert layout (16 of its 64 experts) run across worlds of `--world-sizes` ranks on the GPU(s) and
are judged against transformers on the same device (the reference in the test dtype through cuBLAS, the
float64 truth beside it). Weights are drawn from the seeds on the machine that runs this, on first use.
Skipped without CUDA (`--device cuda`, or `auto` on a GPU machine); marked `gpu`.

Run it in one test process, apart from the tiny-fixture suite (every rank process holds the production
checkpoints in memory): `python -m pytest property_tests/test_gpu.py -p no:xdist --device cuda`
(docs/gpu.md). `DPEP_LARGE_DRYRUN=1` runs the same tests on CPU-sized stand-ins, to check the code paths.
`DPEP_LARGE_DTYPES` (default bfloat16) picks the dtypes; the hypothesis properties take a quarter of the
profile's examples (at least 4).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.numerics import PrecisionPool
from dpep_parity.checks.core.records import expect
from dpep_parity.checks.core.topology import Layout, valid_layouts
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.checks.tools.bench_gpu import evict_if_needed
from dpep_parity.fixtures.build import fixture_path
from dpep_parity.fixtures.large import DRYRUN_FIXTURES, LARGE_FIXTURES
from dpep_parity.property_tests import search
from dpep_parity.property_tests.pooled import HALF, pooled_precision
from dpep_parity.property_tests.strategies import Example

pytestmark = pytest.mark.gpu

DRYRUN = os.environ.get("DPEP_LARGE_DRYRUN") == "1"
FAMILY = DRYRUN_FIXTURES if DRYRUN else LARGE_FIXTURES
QWEN3, QWEN2 = sorted(FAMILY, key=lambda n: not n.startswith("qwen3"))
DTYPES = tuple(os.environ.get("DPEP_LARGE_DTYPES", "bfloat16").split(","))
EXAMPLES = max(4, settings.default.max_examples // 4)


@pytest.fixture(scope="module")
def gpu(suite):
    if not DRYRUN:
        import torch
        if suite.device != "cuda" or not torch.cuda.is_available():
            pytest.skip("production-size tier: needs CUDA (--device cuda, or auto on a GPU machine)")
    return suite


def spec_config(name: str) -> dict:
    s = FAMILY[name]
    return {k: getattr(s, k) for k in s.__dataclass_fields__}


def run(suite, unit: str, ex: Example, target: str | None = None, layout_reference: bool = False):
    evict_if_needed(ex.layout.tp, suite.device, suite.deadline)
    return run_example(target or suite.target, unit, str(fixture_path(ex.fixture)), ex.layout, ex.batch,
                       ex.dtype, ex.layer, suite.device, suite.deadline, layout_reference=layout_reference)


def explain(res, unit, ex, target) -> str:
    return f"{res.report()}\nreplay: {ex.replay(unit, target)} --device cuda"


# ---------------- strategies: production-size batches ----------------
@st.composite
def large_rank(draw, mode: str) -> tuple[R, ...]:
    if mode == "idle":
        return ()
    if mode == "decode":
        return tuple(R(draw(st.integers(1, 64)), 1) for _ in range(draw(st.integers(1, 16))))
    return tuple(R(draw(st.integers(0, 32)), draw(st.integers(1, 48))) for _ in range(draw(st.integers(1, 2))))


@st.composite
def large_examples(draw, world_sizes, dtypes) -> Example:
    fixture = draw(st.sampled_from(sorted(FAMILY)))
    lays = [lay for ws in sorted(world_sizes) for lay in valid_layouts(ws, spec_config(fixture))]
    layout = draw(st.sampled_from(lays))
    modes = draw(st.lists(st.sampled_from(["extend", "idle", "decode"]), min_size=layout.dp, max_size=layout.dp))
    if all(m == "idle" for m in modes):
        modes[0] = "decode"
    batch = Batch(tuple(draw(large_rank(m)) for m in modes), draw(st.integers(0, 2**16)))
    return Example(fixture, layout, batch, draw(st.sampled_from(list(dtypes))), 0)


def _check(suite, unit, data):
    ex = data.draw(large_examples(suite.world_sizes, DTYPES), label="example")
    res = run(suite, unit, ex)
    search.accept(unit, ex, res)
    expect(res, explain(res, unit, ex, suite.target), ex.replay(unit, suite.target))


@search.floor
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_large_moe_parity(gpu, data):
    """The MoE block at production shapes equals one device, every layout, idle and decoding ranks."""
    _check(gpu, "moe", data)


@search.floor
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_large_decoder_parity(gpu, data):
    """The decoder layer at production shapes: attention (GQA 32/4 or 28/4 heads), DP gather, MoE."""
    _check(gpu, "decoder", data)


# ---------------- pinned: 1, 2 and 4 ranks, both padding modes ----------------
EXTEND_IDLE4 = Batch(((R(0, 24), R(16, 8)), (), (R(4, 12),), (R(0, 1),)), 5)
DECODE_UNEVEN2 = Batch((tuple(R(8 + i, 1) for i in range(12)), tuple(R(3 + i, 1) for i in range(7))), 6)
DECODE_UNEVEN4 = Batch((tuple(R(8 + i, 1) for i in range(6)), (R(5, 1),), tuple(R(2 + i, 1) for i in range(5)),
                        (R(9, 1), R(1, 1))), 7)
EXTEND1 = Batch(((R(0, 40), R(24, 16)),), 8)

PINS = [
    (Layout(1, 1, 1), EXTEND1),
    (Layout(2, 2, 2), DECODE_UNEVEN2),      # MAX_LEN, attention TP 1, EP 2
    (Layout(2, 1, 1), EXTEND1),             # pure TP: KV heads split 4 -> 2 + 2
    (Layout(4, 4, 4), EXTEND_IDLE4),        # SUM_LEN with an idle rank, EP 4
    (Layout(4, 2, 2), DECODE_UNEVEN2),      # MAX_LEN, attention TP 2, MoE TP 2
    (Layout(4, 4, 1), DECODE_UNEVEN4),      # MAX_LEN, every rank a DP rank, MoE TP 4
]
PINNED = [(unit, fx, lay, b, dt) for unit in ("moe", "decoder") for fx in (QWEN3, QWEN2)
          for lay, b in PINS for dt in DTYPES]


@pytest.mark.parametrize("unit,fixture,layout,batch,dtype", PINNED,
                         ids=[f"{u}-{f}-{l}-{d}" for u, f, l, _, d in PINNED])
def test_large_pinned(gpu, unit, fixture, layout, batch, dtype):
    if layout.tp not in gpu.world_sizes:
        pytest.skip("outside this run's --world-sizes")
    ex = Example(fixture, layout, batch, dtype, 0)
    res = run(gpu, unit, ex)
    assert not res.skipped and res.ok, explain(res, unit, ex, gpu.target)
    print(f"\n{unit} {fixture} {layout} {dtype}: {res.verdict.worst_excess:.2f}x bound, "
          f"{res.verdict.tie_rows}/{res.verdict.rows} tie rows")


def test_oracle_answers_are_settled_cpu_rows_equal_to_synchronous_copies(gpu):
    """The oracle queues its copies to and from the GPU without waiting (checks/oracle/reference.py: `_to_host`,
    `_to_device`, `_settled`): what its calls return is on the CPU, complete, and equal bit for bit to the same
    forwards copied back one synchronous `.cpu()` at a time, for the truth, the reference, the router taps and
    the decoys, on the production-size MoE block; in one thread and with the oracle's worker thread (`threaded`)."""
    from functools import partial

    import torch

    from dpep_parity.checks import units
    from dpep_parity.checks.harness.unitjob import load_weights
    from dpep_parity.checks.oracle.reference import Oracle, _RouterTap
    path, dtype = str(fixture_path(QWEN3)), DTYPES[0]
    config, _ = load_weights(path)
    batch = Batch(((R(0, 24), R(0, 8)), tuple(R(16 + j, 1) for j in range(8))), seed=5)
    moe = units.get("moe")
    for threaded in (False, True):      # as checks.judge.parity.oracle_outputs, one thread and the worker thread
        o = Oracle(path, dtype, gpu.device, threaded=threaded)
        x = moe.global_inputs(batch, config, o.dtype)[0]
        got, decoys = o.answer(partial(o.mlp, 0, x), partial(o.decoy_rows, 0, batch, x))
        for name, model, dt, out, probs in (("truth", o.truth_model, torch.float64, got.truth, got.router[0][0]),
                                            ("reference", o.ref_model, o.dtype, got.ref, got.router[0][1])):
            with torch.no_grad(), _RouterTap(model) as tap:
                want = model.model.layers[0].mlp(x.to(dt).to(next(model.parameters()).device)[None])
                want = (want[0] if isinstance(want, tuple) else want).reshape(x.shape[0], -1).cpu()
                want_probs = torch.softmax(tap.logits[0], dim=-1).cpu()
            assert out.device.type == "cpu" and torch.equal(out, want), (name, threaded)
            assert torch.equal(probs, want_probs), f"{name} router probabilities (threaded {threaded})"
        assert all(d.device.type == "cpu" and d.shape == got.ref.shape and torch.isfinite(d.float()).all()
                   for d in decoys)
        assert torch.equal(decoys[0], o.decoy_rows(0, batch, x)[0])     # settled: the same answer twice


@pytest.mark.parametrize("unit", ["moe", "decoder"])
def test_truth_on_its_own_stream_answers_as_after_the_reference(gpu, unit):
    """The float64 truth on a CUDA stream of its own, beside the reference and the decoys (`Oracle(truth_stream=
    True)`, checks/oracle/reference.py `_on_truth_stream`), and the truth and the reference queued by the oracle's
    worker thread beside the decoys (`threaded`, `Oracle.answer`, on streams of their own) answer bit for bit as
    everything in line on the current stream of one thread (`truth_stream=False, threaded=False`): truth,
    reference, router taps and decoys, for the MoE block (rows) and the decoder layer (right-padded requests), on
    the production-size layer."""
    from functools import partial

    import torch

    from dpep_parity.checks import units
    from dpep_parity.checks.harness.unitjob import load_weights
    from dpep_parity.checks.oracle.reference import Oracle
    path, dtype = str(fixture_path(QWEN3)), DTYPES[0]
    config, _ = load_weights(path)
    u = units.get(unit)
    batch = Batch(((R(8, 24), R(0, 8)), tuple(R(16 + j, 1) for j in range(8))), seed=7)
    answers = []
    for side, threaded in ((True, True), (True, False), (False, False)):
        o = Oracle(path, dtype, gpu.device, truth_stream=side, threaded=threaded)
        assert (o.truth_stream is not None) == (side and not DRYRUN)     # dry run: on the CPU, no stream
        inputs = u.global_inputs(batch, config, o.dtype)
        answers.append(o.answer(partial(u.reference, o, 0, batch, inputs), partial(u.decoys, o, 0, batch, inputs)))
    (after, dec_after) = answers[-1]
    for beside, dec_beside in answers[:-1]:
        assert torch.equal(beside.truth, after.truth) and torch.equal(beside.ref, after.ref)
        for (pt, pr), (qt, qr) in zip(beside.router, after.router, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(pt + pr, qt + qr, strict=True)), "router probabilities"
        assert len(dec_beside) == len(dec_after) and all(torch.equal(a, b) for a, b in zip(dec_beside, dec_after))


# ---------------- the catalog at production size ----------------
KILLS = [
    ("B14", "moe", QWEN3, Layout(4, 2, 2), DECODE_UNEVEN2),       # double reduction (MAX_LEN)
    ("B14", "decoder", QWEN3, Layout(2, 2, 2), DECODE_UNEVEN2),
    ("B15", "moe", QWEN2, Layout(4, 4, 4), EXTEND_IDLE4),         # replicated shared expert, summed x tp
    ("B15", "decoder", QWEN2, Layout(2, 1, 1), EXTEND1),
]


@pytest.mark.parametrize("mutant,unit,fixture,layout,batch", KILLS,
                         ids=[f"{m}-{u}-{f}-{l}" for m, u, f, l, _ in KILLS])
def test_large_mutant_killed(gpu, mutant, unit, fixture, layout, batch):
    """The spec passes and the mutant fails the parity property on the same production-size example."""
    if layout.tp not in gpu.world_sizes:
        pytest.skip("outside this run's --world-sizes")
    dtype = DTYPES[0]
    ex = Example(fixture, layout, batch, dtype, 0)
    spec = run(gpu, unit, ex, "spec")
    assert spec.ok, explain(spec, unit, ex, "spec")
    mres = run(gpu, unit, ex, f"checks.catalog.mutants:{mutant}")
    assert not mres.ok, f"mutant {mutant} survived:\n{mres.report()}"
    assert "parity" in {c.prop for c in mres.failures()}, mres.report()
    v = mres.verdict
    print(f"\n{mutant} {unit} {fixture} {layout} {dtype}: spec {spec.verdict.worst_excess:.2f}x bound; "
          f"mutant {v.worst_excess:.1f}x bound, |sut|/|truth| {v.ratio:.3f}, "
          f"{len(v.failing_rows)}/{v.rows} rows beyond, {v.tie_rows} tie rows")


# ---------------- precision (test_precision.py's pooled test) at production size ----------------
@st.composite
def large_busy(draw, world_sizes, dtypes) -> Example:
    """Every DP rank extends 1-2 requests of 8-48 tokens after a short or a long (64-1024) prefix."""
    fixture = draw(st.sampled_from(sorted(FAMILY)))
    lays = [lay for ws in sorted(world_sizes) for lay in valid_layouts(ws, spec_config(fixture))]
    layout = draw(st.sampled_from(lays))
    per = tuple(tuple(R(draw(st.one_of(st.integers(0, 32), st.integers(64, 1024))), draw(st.integers(8, 48)))
                      for _ in range(draw(st.integers(1, 2)))) for _ in range(layout.dp))
    return Example(fixture, layout, Batch(per, draw(st.integers(0, 2**16))), draw(st.sampled_from(list(dtypes))), 0)


def _halves():
    halves = [d for d in DTYPES if d in HALF]
    if not halves:
        pytest.skip(f"no half-precision dtype in DPEP_LARGE_DTYPES={','.join(DTYPES)}")
    return halves


@pytest.mark.parametrize("unit", ["moe", "decoder"])
def test_large_precision(gpu, unit):
    """No precision-class excess at production shapes, pooled over the run (docs/precision.md)."""
    pooled_precision(unit, large_busy(gpu.world_sizes, _halves()),
                     lambda ex: run(gpu, unit, ex, layout_reference=True), lambda res, ex: None,
                     lambda ex: f"{ex.replay(unit, gpu.target)} --device cuda", max_examples=EXAMPLES)


PRECISION_PINS = [(Layout(1, 1, 1), Batch(((R(0, 384), R(300, 320)),), 11)),       # ~700 tokens each: a
                  (Layout(2, 1, 1), Batch(((R(700, 320), R(4, 384)),), 12)),        # precision fault adds
                  (Layout(2, 2, 2), Batch(((R(0, 256), R(96, 128)), (R(500, 384),)), 13)),   # ~5 % energy
                  (Layout(4, 2, 2), Batch(((R(128, 384),), (R(0, 192), R(900, 192))), 14))]  # at these sizes


# P01 (norm statistics in bfloat16) is not here: at production size it adds ~2 % to the decoder's error energy
# (measured on the H200: pooled +0.019, z=1.7 over these ~2,800 tokens; docs/precision.md), which this tier
# cannot resolve at its cost; the tiny fixtures' tiers kill it.
@pytest.mark.parametrize("mutant", ["P04"])
def test_large_precision_mutant_killed(gpu, mutant):
    """On the same production-size examples (decoder, long and short prefixes) the spec passes every check and
    the pooled precision test, and the precision mutant fails one of them."""
    dtype = _halves()[0]
    verdicts = {}
    for target in ("spec", f"checks.catalog.mutants:{mutant}"):
        pool, failed = PrecisionPool(), []
        for layout, batch in PRECISION_PINS:
            if layout.tp not in gpu.world_sizes:
                continue
            ex = Example(QWEN3, layout, batch, dtype, 0)
            res = run(gpu, "decoder", ex, target, layout_reference=True)
            failed += [f"{layout}: {c.prop}" for c in res.failures()]
            pool.add(str(layout), res.precision or [])
        verdicts[target] = (pool.verdict(), failed)
    (spec_v, spec_failed), (mut_v, mut_failed) = verdicts.values()
    assert spec_v.ok and not spec_failed, f"spec: {spec_failed} {spec_v.reason}"
    assert not mut_v.ok or mut_failed, f"{mutant} survived: pooled {mut_v.mean:+.3f} (z={mut_v.z:.1f})"
    print(f"\n{mutant} decoder {QWEN3} {dtype}: spec pooled {spec_v.mean:+.3f} (z={spec_v.z:.1f}); mutant pooled "
          f"{mut_v.mean:+.3f} (z={mut_v.z:.1f}), other checks failed: {mut_failed or 'none'}")
