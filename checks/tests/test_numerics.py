"""The tolerance model, measured at a realistic size: honest reorderings pass, real bugs fail, and say why.

X [512, 2048] @ W [2048, 512] (a reduction length of real hidden sizes); truth in float64 of the
dtype-rounded inputs; reference = one matmul in the dtype. The split-K system is checks.tools.calibrate.split_k,
the measurement `python -m checks.tools.calibrate` prints as a table.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpep_parity.checks.core.numerics import compare, near_ties, ulp
from dpep_parity.checks.tools import calibrate

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SIZE = (512, 2048, 512)
ROWS = SIZE[0]
LABELS = [f"dp{r // 128} req{(r // 32) % 4} tok{r % 32}" for r in range(ROWS)]


@functools.lru_cache(maxsize=None)
def case(dtype_name: str, seed: int = 0):
    return calibrate.gemm_case(DTYPES[dtype_name], seed, SIZE)


def row_ulp(truth: torch.Tensor, row: int, dtype) -> float:
    return float(ulp(truth[row].abs().max(), dtype))


# ---------------- (a, e) honest reorderings pass ----------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_split_k_reduction_passes_on_every_row(dtype, parts):
    x, w, truth, ref = case(dtype)
    sut = calibrate.split_k(x, w, parts, seed=parts)
    assert sut.dtype == ref.dtype
    # the reordering is real: many elements differ from the reference, and from the truth
    assert (sut != ref).float().mean() > 0.05
    v = compare(f"split-K/{parts}", sut, truth, ref, DTYPES[dtype], fan_in=parts, labels=LABELS)
    assert v.ok, str(v)
    assert v.failing_rows == [] and v.worst_excess < 1.0 and v.max_abs > 0
    assert abs(v.ratio - 1) < 1e-3 and v.cosine > 0.9999


def test_split_k_needs_its_fan_in_floor():
    """bf16 partials rounded before the sum: against the bare 2x-reference criterion (no per-rank floor,
    i.e. a bound of 2 err_ref + 1 ulp is what fan_in=0 gives) some rows do exceed; the floor is needed."""
    x, w, truth, ref = case("bfloat16")
    sut = calibrate.split_k(x, w, 8, seed=8)
    assert not compare("no floor", sut, truth, ref, torch.bfloat16, fan_in=0).ok
    assert compare("floor", sut, truth, ref, torch.bfloat16, fan_in=8).ok


# ---------------- (b) systematic bias ----------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_ulp_bias_fails_as_systematic_bias(dtype):
    x, w, truth, ref = case(dtype)
    sut = calibrate.biased(ref)
    assert ((sut.double() - ref.double()) > 0).all()            # every element moved up by one step
    v = compare("biased", sut, truth, ref, DTYPES[dtype], fan_in=2, labels=LABELS)
    assert not v.ok
    assert v.failing_rows == []          # invisible to the max-error bound: the bias test caught it
    assert any("systematic bias" in r for r in v.reasons), v.reasons
    assert v.bias_z > 6 and v.bias_ulp - v.ref_bias_ulp > 0.25
    # the same shift downward is caught with the opposite sign
    down = torch.nextafter(ref, torch.full_like(ref, float("-inf")))
    vd = compare("biased down", down, truth, ref, DTYPES[dtype], fan_in=2)
    assert not vd.ok and vd.bias_z < -6


# ---------------- (c) double reduction ----------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_doubled_output_fails_with_ratio_two(dtype):
    x, w, truth, ref = case(dtype)
    v = compare("doubled", calibrate.doubled(ref), truth, ref, DTYPES[dtype], fan_in=4, labels=LABELS)
    assert not v.ok
    assert abs(v.ratio - 2.0) < 1e-3
    assert len(v.failing_rows) == ROWS
    assert any("|sut|/|truth| = 2.00" in r for r in v.reasons), v.reasons
    assert "|sut|/|truth|=2.00" in str(v)


# ---------------- (d) one corrupted row ----------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_corrupted_row_is_named(dtype):
    dt = DTYPES[dtype]
    x, w, truth, ref = case(dtype)
    bad_row, col = 413, 77
    sut = ref.clone()
    sut[bad_row, col] += 64 * row_ulp(truth, bad_row, dt)
    v = compare("corrupt", sut, truth, ref, dt, fan_in=1, labels=LABELS)
    assert not v.ok
    assert v.failing_rows == [bad_row]
    assert (v.worst_row, v.worst_col, v.worst_label) == (bad_row, col, LABELS[bad_row])
    assert LABELS[bad_row] in v.reasons[0] and LABELS[bad_row] in str(v)
    assert f"1 of {ROWS} rows" in v.reasons[0]
    # without labels the row number is named
    assert f"row {bad_row}" in compare("corrupt", sut, truth, ref, dt).reasons[0]


# ---------------- (f) shapes and non-finite values ----------------
def test_shape_mismatch_fails_naming_both_shapes():
    x, w, truth, ref = case("bfloat16")
    v = compare("shape", ref[:-1], truth, ref, torch.bfloat16)
    assert not v.ok
    assert "(511, 512)" in v.reasons[0] and "(512, 512)" in v.reasons[0]
    v = compare("shape", ref.reshape(512, 2, 256), truth, ref, torch.bfloat16)
    assert not v.ok and "(512, 2, 256)" in v.reasons[0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_fail(bad):
    x, w, truth, ref = case("bfloat16")
    sut = ref.clone()
    sut[345, 9] = bad
    v = compare("nonfinite", sut, truth, ref, torch.bfloat16, labels=LABELS)
    assert not v.ok
    assert "non-finite" in v.reasons[0] and LABELS[345] in v.reasons[0]


@pytest.mark.parametrize("where", ["truth", "ref", "variant"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_oracle_is_no_verdict_rather_than_a_pass(where, bad):
    """A NaN in the truth, the reference or a variant made every bound NaN, and a row off by half its value
    passed: now the comparison refuses to judge, naming the row (the finite case, the control, still fails)."""
    x, w, truth, ref = case("bfloat16")
    truth, ref = truth.clone(), ref.clone()        # the case is shared by other tests: mutate copies
    sut = ref.clone()
    sut[7] *= 1.5
    variant = ref.clone()
    assert not compare("finite", sut, truth, ref, torch.bfloat16, ref_variants=[variant], labels=LABELS).ok
    {"truth": truth, "ref": ref, "variant": variant}[where][12, 3] = bad
    with pytest.raises(ValueError, match=f"not finite at {LABELS[12]}"):
        compare("nonfinite oracle", sut, truth, ref, torch.bfloat16, ref_variants=[variant], labels=LABELS)


def test_ulp_of_nan_is_nan():
    got = ulp(torch.tensor([float("nan"), 1.0], dtype=torch.float64), torch.bfloat16)
    assert torch.isnan(got[0]) and got[1] == torch.finfo(torch.bfloat16).eps


def test_reference_itself_and_empty_rows_pass():
    x, w, truth, ref = case("bfloat16")
    assert compare("ref", ref, truth, ref, torch.bfloat16).ok
    empty = torch.zeros(0, 16, dtype=torch.float64)
    assert compare("empty", empty.bfloat16(), empty, empty.bfloat16(), torch.bfloat16).ok


# ---------------- (g) router near-ties ----------------
def router_case(rows=256, experts=8, top_k=2, seed=0):
    """Logits with a clear gap (1.0) between the top_k-th and (top_k+1)-th expert on even rows and a gap
    of 1e-4 (far below bf16 rounding) on odd rows; probabilities in float64 (truth) and from the logits
    rounded to bf16 (reference)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(rows, experts, dtype=torch.float64)
    ties = torch.arange(rows) % 2 == 1
    for r in range(rows):
        above = torch.rand(top_k - 1, generator=g, dtype=torch.float64).mul(2).sort(descending=True).values
        below = torch.rand(experts - top_k - 1, generator=g, dtype=torch.float64) * 2 - 6
        kth = torch.rand((), generator=g, dtype=torch.float64) - 0.5      # the top_k-th, below `above`
        nxt = kth - (1e-4 if ties[r] else 1.0)
        row = torch.cat([above + 1, kth.view(1), nxt.view(1), below])[: experts]
        logits[r] = row[torch.randperm(experts, generator=g)]
    p_truth = torch.softmax(logits, -1)
    p_ref = torch.softmax(logits.to(torch.bfloat16).double(), -1)
    return p_truth, p_ref, ties


def test_near_ties_finds_constructed_ties_only():
    p_truth, p_ref, ties = router_case()
    found = near_ties(p_truth, p_ref, top_k=2, dtype=torch.bfloat16)
    assert found.dtype == torch.bool
    assert torch.equal(found, ties)
    # the tie is between the 2nd and 3rd expert: it is no tie for top-1 or top-3
    assert not near_ties(p_truth, p_ref, top_k=1, dtype=torch.bfloat16)[ties].any()


def test_near_ties_scale_with_the_reference_noise():
    """In float32 the comparison's own ulp is ~1e-8: whether a 1e-4 logit gap is a tie depends only on how
    much the reference's probabilities moved."""
    p_truth, _, ties = router_case()
    assert not near_ties(p_truth, p_truth.clone(), top_k=2, dtype=torch.float32).any()
    g = torch.Generator().manual_seed(3)
    noisy = p_truth * (1 + 1e-3 * torch.randn(p_truth.shape, generator=g, dtype=torch.float64))
    assert torch.equal(near_ties(p_truth, noisy, top_k=2, dtype=torch.float32), ties)


def test_near_ties_degenerate_shapes():
    p = torch.softmax(torch.randn(5, 4, dtype=torch.float64), -1)
    assert not near_ties(p, p, top_k=4, dtype=torch.bfloat16).any()
    assert near_ties(p[:0], p[:0], top_k=2, dtype=torch.bfloat16).shape == (0,)


def test_excused_rows_count_as_tie_flips_not_failures():
    dt = torch.bfloat16
    x, w, truth, ref = case("bfloat16")
    excused = torch.zeros(ROWS, dtype=torch.bool)
    excused[[3, 9]] = True
    sut = ref.clone()
    sut[3, 0] += 50 * row_ulp(truth, 3, dt)           # a tie row that flipped
    v = compare("ties", sut, truth, ref, dt, excused=excused, labels=LABELS)
    assert v.ok, str(v)
    assert (v.tie_rows, v.tie_flips, v.failing_rows) == (2, 1, [])
    assert v.worst_row != 3                            # the excused row is not reported as the worst
    sut[7, 0] += 50 * row_ulp(truth, 7, dt)           # and a row that is no tie
    v = compare("ties", sut, truth, ref, dt, excused=excused, labels=LABELS)
    assert not v.ok
    assert (v.tie_flips, v.failing_rows, v.worst_label) == (1, [7], LABELS[7])


# ---------------- (h) ulp ----------------
def spacing(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))).double() - a.double())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@settings(max_examples=60, deadline=None)
@given(vals=st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=64),
       scale=st.integers(-30, 30))
def test_ulp_is_the_spacing_of_the_dtype(dtype, vals, scale):
    dt = DTYPES[dtype]
    x = (torch.tensor(vals, dtype=torch.float64) * 2.0 ** scale).to(dt)
    x = x[torch.isfinite(x) & (x.abs() < torch.finfo(dt).max)]
    got = ulp(x, dt)
    assert got.dtype == torch.float64
    assert torch.equal(got, spacing(x)), (x, got, spacing(x))
    assert torch.equal(ulp(-x, dt), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_ulp_on_random_magnitudes(dtype):
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(1)
    fi = torch.finfo(dt)
    lo, hi = torch.log2(torch.tensor(fi.tiny)).item() - 8, torch.log2(torch.tensor(fi.max)).item() - 1
    e = torch.rand(20000, generator=g, dtype=torch.float64) * (hi - lo) + lo
    x = (torch.randn(20000, generator=g, dtype=torch.float64).sign() * 2.0 ** e).to(dt)
    assert torch.equal(ulp(x, dt), spacing(x))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_ulp_of_float64_magnitudes_just_below_a_power_of_two(dtype):
    """A float64 magnitude (the truth's) in [2^(k-1), 2^k) is measured in the spacing of that binade, even one
    float64 step below 2^k, where log2 rounds up to k: the earlier `pow(2, floor(log2 x))` gave twice the
    spacing there (the negative control, written out below), a bound 2x too loose on such rows."""
    dt = DTYPES[dtype]
    fi = torch.finfo(dt)
    k = torch.arange(-10, 12, dtype=torch.float64)
    below = 2.0 ** k * (1 - 2.0 ** -53)                 # the largest float64 under 2^k
    want = 2.0 ** (k - 1) * fi.eps
    assert torch.equal(ulp(below, dt), want)
    assert torch.equal(ulp(2.0 ** k, dt), 2.0 ** k * fi.eps)
    old = torch.clamp(torch.pow(2.0, torch.floor(torch.log2(below))) * fi.eps, min=fi.tiny * fi.eps)
    assert torch.equal(old[k.abs() >= 3], 2 * want[k.abs() >= 3])     # log2 rounds up to k for |k| >= 3


def test_reference_variants_widen_the_noise_estimate():
    """A lucky reference (tiny error on a row) must not make a legitimate layout fail when another
    legitimate evaluation of the same row shows larger rounding; a wrong row still fails."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(4, 64, generator=g, dtype=torch.float64)
    u = ulp(truth.abs().amax(1), torch.float32)[:, None]
    lucky = truth + 0.5 * u                       # reference: half an ulp everywhere
    other = truth + 6 * u                         # the same rows among other rows: 6 ulp
    sut = (truth + 9 * u).float()                 # 9 ulp: > 2 x 0.5 + 5 floor, < 2 x 6 + 5
    assert not compare("alone", sut, truth, lucky.float(), torch.float32, fan_in=4).ok
    assert compare("pooled", sut, truth, lucky.float(), torch.float32, fan_in=4, ref_variants=[other.float()]).ok
    wrong = sut.clone()
    wrong[2] += 1e-3
    v = compare("wrong", wrong, truth, lucky.float(), torch.float32, fan_in=4, ref_variants=[other.float()])
    assert not v.ok and v.failing_rows == [2]
