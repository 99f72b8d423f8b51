"""The tolerance model: a layout passes where its error against the float64 truth stays within what one
device legitimately makes in the same dtype, plus the rounding the layout itself adds.

Per token row r (rows are the unit of ownership: a row belongs to one request on one DP rank):

    err_sut[r] = max_j |sut - truth|     err_ref[r] = max_j, over reference evaluations, |ref - truth|
    u[r] = ulp(max_j |truth[r]|)         noise[r] = max(err_ref[r], u[r] * max_s err_ref[s] / u[s])
    pass  iff  err_sut[r] <= FACTOR * noise[r] + (fan_in + 1) * u[r]

- FACTOR = 2 is FlashAttention's criterion ("at most 2x the error of the reference in the same precision",
  a max over the whole tensor): the layout runs the same operations as the reference in another order,
  so its rounding error has the same size as the reference's; 2x leaves room for the order.
- The reference noise is a sample, so it is taken wide: over several legitimate one-device evaluations
  of the same rows (`ref_variants`: the rows among decoy rows or decoy requests, since GEMM blocking
  depends on the batch; a fuzz run found a 1-token row whose lone reference error was 1.3e-7 against
  5.9e-7 among 8 rows), and pooled over rows s in ulps of each row's magnitude, leaving out rows that
  are excused or where the reference itself routed a near-tie token differently (not rounding noise).
  A wrong row still fails by orders of magnitude.
- The floor covers what the reference does not do at all: a reduction over `fan_in` ranks rounds each
  rank's partial to the dtype (<= 0.5 ulp each) and sums them in the dtype (fan_in - 1 roundings of <= 0.5
  ulp): fan_in ulp in all, plus 1 ulp for the final cast. Measured (checks/tests/test_numerics.py, and
  `python -m checks.tools.calibrate`): split-K bf16 reductions over 2..8 partials at realistic sizes stay
  within this bound on every row, while a 1-ulp systematic bias and a 2x reduction are far outside.
  fp32 accumulation error has a heavy tail on long sums: before the noise was pooled over rows, a pure
  reorder of a 1024x2048 @ 2048x1024 fp32 GEMM exceeded a per-row bound on 1 row of 1 GEMM in 20 (seed
  22, row 845, 1.16x); pooled, the same row sits at 0.54x (`checks.tools.calibrate.measure(torch.float32, 1, 22)`).
- Systematic bias is invisible to a max-error bound (a 1-ulp shift is smaller than 2x the reference's
  rounding noise), so a second test compares the mean signed error, in ulps of each element's magnitude,
  with the reference's: rows are the clusters (errors inside a row share the norm's scale), and the shift
  must be both significant (|z| > BIAS_Z over rows) and larger than BIAS_MIN_ULP. Reordered reductions are
  unbiased (round-to-nearest-even), so they pass. Replicas of one token (every attention-TP rank returns
  its DP group's rows) count once: a fuzz run found 8 replicas of 2 tokens read as 16 samples (z=-6.7).
- Precision faults (an intermediate kept in the activation dtype where the single-device model keeps float32)
  are invisible to both tests above: their error in bfloat16 is the size of a legitimate reordering's, and
  unbiased. The precision test pools evidence instead (`precision_sample`, `PrecisionPool`; the property is
  property_tests/test_precision.py; measurements in docs/precision.md). Per token (replicas count once) the
  error energy E = mean_j ((x - truth) / u)^2 of the target is compared with that of every legitimate
  same-dtype computation of the same rows: the reference, its decoy-company variants, and the spec run at
  the same layout, which makes exactly the layout's legitimate extra roundings (TP partials rounded per
  rank and summed in the dtype; the reference cannot emulate them). The statistic is
  l = log(E_target / max(E_legit)). TorchInductor's accuracy check compares RMS errors against the float64
  result with a multiplier (2x) on one tensor; a precision fault adds 5-15 % RMS error, far inside any
  multiplier, so instead the l of every token of every example of a run is pooled and tested against 0:
  the comparator is the largest legitimate error, so a legitimate target sits below 0 (its l is the log of
  one legitimate energy over the max of several; measured -0.004 to -0.06 on every variant and layout),
  and the run fails when mean(l) > 0 at z > PRECISION_Z over tokens (the bias test's significance). The
  multiplier is thus 1 on the largest legitimate error, with the statistics, not a margin, deciding.
  Tokens that fail the bound or are excused as router near-ties are left out (their error is not rounding).
- Router near-ties (`near_ties`, judged in logit space): a token whose k-th and (k+1)-th experts are
  within the rounding noise of swapping may route differently in another layout. When the target reports
  its routing, checks.judge.parity excuses such a row only where the routing really differs (and a different
  choice away from a tie fails); otherwise every near-tie row is excused. Excused rows are counted and
  reported; a row beyond the bound that is not excused fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

FACTOR = 2.0
BIAS_Z = 6.0
BIAS_MIN_ULP = 0.25
BIAS_MIN_ROWS = 16
PRECISION_Z = BIAS_Z
ENERGY_FLOOR = 1e-3   # ulp^2: an exact row (energy 0) against an exact comparator is no evidence either way


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


_EXPONENT_BITS = 0x7FF0000000000000   # of a float64: x with its mantissa cleared is 2 ** floor(log2 |x|)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at |x| (float64), never below the smallest normal's spacing:
    2 ** floor(log2 |x|) x eps, the power of two read exactly off the float64's exponent bits. (It was
    `pow(2, floor(log2 x))`, which is 2x too large just below a power of two, where log2 rounds up to the
    integer, and slower: checks/tests/test_numerics.py.)"""
    fi = torch.finfo(dtype)
    x = torch.clamp(x.abs().to(torch.float64), min=fi.tiny)
    power = (x.view(torch.int64) & _EXPONENT_BITS).view(torch.float64)
    power = torch.where(torch.isnan(x), x, power)     # a NaN stays NaN (its bits would read as inf)
    return torch.clamp(power * fi.eps, min=fi.tiny * fi.eps)


@dataclass
class Verdict:
    name: str
    ok: bool
    dtype: str
    rows: int
    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_ulp: float = 0.0
    cosine: float = 1.0
    ratio: float = float("nan")     # |sut| / |truth| over all rows: 2.0 is a double reduction
    worst_row: int = -1
    worst_col: int = -1
    worst_label: str = ""
    worst_excess: float = 0.0       # err_sut / bound at the worst row
    failing_rows: list[int] = field(default_factory=list)
    tie_rows: int = 0
    tie_flips: int = 0
    bias_ulp: float = 0.0
    ref_bias_ulp: float = 0.0
    bias_z: float = 0.0
    reasons: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{self.name}: {'PASS' if self.ok else 'FAIL'} ({self.dtype}, {self.rows} rows)"
        body = (f"  max|err|={self.max_abs:.3g} mean|err|={self.mean_abs:.3g} max_ulp={self.max_ulp:.1f} "
                f"cosine={self.cosine:.6f} |sut|/|truth|={self.ratio:.4f}\n"
                f"  worst: {self.worst_label} element {self.worst_col}, error {self.worst_excess:.2f}x its bound\n"
                f"  near-tie rows: {self.tie_rows} (of which beyond bound: {self.tie_flips}); "
                f"bias {self.bias_ulp:+.3f} ulp vs reference {self.ref_bias_ulp:+.3f} (z={self.bias_z:.1f})")
        reasons = "".join(f"\n  - {r}" for r in self.reasons)
        return f"{head}\n{body}{reasons}"


def compare(name: str, sut: torch.Tensor, truth: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
            fan_in: int = 1, excused: torch.Tensor | None = None,
            labels: Sequence[str] | None = None, ref_variants: Sequence[torch.Tensor] = (),
            clusters: Sequence[object] | None = None, unpooled: torch.Tensor | None = None) -> Verdict:
    """Judge `sut` ([rows, cols]) against float64 `truth`, using `ref` (same rows, one device, `dtype`);
    `ref_variants`: the same reference computed in other legitimate ways (other batch company): the
    reference noise of a row is the largest of them. `clusters`: one key per row; rows with the same key
    are replicas of one token (attention-TP ranks of a DP group) and count once in the bias test.
    `unpooled`: rows whose reference error is not rounding noise (the reference itself routed a near-tie
    token differently): their own bound uses it, but it is not pooled into the other rows' noise."""
    if tuple(ref.shape) != tuple(truth.shape):
        raise ValueError(f"reference shape {tuple(ref.shape)} != truth shape {tuple(truth.shape)}")
    if tuple(sut.shape) != tuple(truth.shape):
        return Verdict(name, False, str(dtype).replace("torch.", ""), truth.shape[0] if truth.dim() else 0,
                       reasons=[f"shape {tuple(sut.shape)} != expected {tuple(truth.shape)}"])
    rows = truth.shape[0]
    v = Verdict(name, True, str(dtype).replace("torch.", ""), rows)
    if rows == 0 or truth.numel() == 0:
        return v
    s, t, r = (x.reshape(rows, -1).to(torch.float64).contiguous() for x in (sut, truth, ref))
    bad = _first_non_finite_row(s)
    if bad is not None:
        v.ok = False
        v.reasons.append(f"non-finite values, first at {_label(labels, bad)}")
        return v
    alts = [alt.reshape(rows, -1).to(torch.float64) for alt in ref_variants]
    for what, x in (("truth", t), ("reference", r), *((f"reference variant {i}", a) for i, a in enumerate(alts))):
        bad = _first_non_finite_row(x)
        if bad is not None:   # a NaN bound passes every row: no verdict, not a pass
            raise ValueError(f"{name}: the oracle's {what} is not finite at {_label(labels, bad)}: no verdict can "
                             "be drawn from it (a fault of the oracle or its fixture, not of the system under test)")
    err = s - t
    d_sut, d_ref = err.abs(), (r - t).abs()
    for alt in alts:
        d_ref = torch.maximum(d_ref, (alt - t).abs())
    e_sut, e_ref = d_sut.amax(1), d_ref.amax(1)
    scale = t.abs().amax(1)
    u_row = ulp(scale, dtype)
    # the reference's noise, pooled over the tensor in ulps of each row's magnitude: one row's max of a
    # few dozen rounding errors is too noisy an estimate on its own (FlashAttention also pools)
    # (over rows not excused as router near-ties: a routing flip in the reference is not rounding noise)
    ex0 = torch.zeros(rows, dtype=torch.bool) if excused is None else excused.to(torch.bool)
    if unpooled is not None:
        ex0 = ex0 | unpooled.to(torch.bool)
    pooled = ((e_ref / u_row)[~ex0].max() if (~ex0).any() else torch.tensor(0.0, dtype=torch.float64)) * u_row
    bound = FACTOR * torch.maximum(e_ref, pooled) + (fan_in + 1) * u_row
    excess = e_sut / bound
    ex = torch.zeros(rows, dtype=torch.bool) if excused is None else excused.to(torch.bool)
    beyond = excess > 1.0
    v.tie_rows, v.tie_flips = int(ex.sum()), int((beyond & ex).sum())
    failing = beyond & ~ex
    v.failing_rows = failing.nonzero().flatten().tolist()
    keep = ~ex
    every = not bool(ex.any())     # the common case: no row excused, no boolean-mask copies
    some = every or bool(keep.any())

    def kept_rows(x):
        return x if every else x[keep]
    v.max_abs = float(kept_rows(d_sut).max()) if some else 0.0
    v.mean_abs = float(kept_rows(d_sut).mean()) if some else 0.0
    u = element_ulp(t, dtype)
    v.max_ulp = float(kept_rows(d_sut / u).max()) if some else 0.0
    sk, tk = kept_rows(s), kept_rows(t)
    t_norm = tk.norm() if some else None
    v.cosine = float(torch.nn.functional.cosine_similarity(sk.flatten(), tk.flatten(), dim=0)) \
        if some and t_norm > 0 else 1.0
    v.ratio = float(sk.norm() / t_norm) if some and t_norm > 0 else float("nan")
    masked = torch.where(keep, excess, torch.zeros_like(excess))
    wr = int(masked.argmax())
    v.worst_row, v.worst_col = wr, int(d_sut[wr].argmax())
    v.worst_label, v.worst_excess = _label(labels, wr), float(masked[wr])
    if v.failing_rows:
        v.ok = False
        v.reasons.append(f"{len(v.failing_rows)} of {rows} rows beyond the bound (2x reference error + "
                         f"{fan_in + 1} ulp); worst {v.worst_label}: |err| {float(e_sut[wr]):.3g} vs bound "
                         f"{float(bound[wr]):.3g}, reference error {float(e_ref[wr]):.3g}; |sut|/|truth| = "
                         f"{v.ratio:.4f}")
    # systematic bias, rows as clusters
    kept = keep.nonzero().flatten()
    if clusters is not None:   # one row per token: replicas are not independent samples
        kept = first_replicas(clusters, kept)
    if len(kept) >= BIAS_MIN_ROWS:
        b_sut = (err / u)[kept].mean(1)
        b_ref = ((r - t) / u)[kept].mean(1)
        diff = b_sut - b_ref
        se = float(diff.std() / math.sqrt(len(kept))) or 1e-30
        v.bias_ulp, v.ref_bias_ulp = float(b_sut.mean()), float(b_ref.mean())
        v.bias_z = float(diff.mean()) / se
        if abs(v.bias_z) > BIAS_Z and abs(float(diff.mean())) > BIAS_MIN_ULP:
            v.ok = False
            v.reasons.append(f"systematic bias of {float(diff.mean()):+.3f} ulp per element beyond the "
                             f"reference's (z={v.bias_z:.1f} over {len(kept)} rows)")
    return v


def element_ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing each element's error is measured in: at its own magnitude, but at least at its row's RMS
    (tiny elements do not blow up); `t` is [rows, cols] float64. Shared by the bias and precision tests."""
    return ulp(torch.maximum(t.abs(), _rms(t)[:, None]), dtype)


def first_replicas(clusters: Sequence[object], rows: torch.Tensor) -> torch.Tensor:
    """Of `rows` (indices, in order), those that are the first of their cluster: replicas of one token (every
    attention-TP rank returns its DP group's rows) count once."""
    seen: set = set()
    first = []
    for i in rows.tolist():      # a list, not the tensor: iterating a tensor makes one tensor per row
        if clusters[i] not in seen:
            seen.add(clusters[i])
            first.append(i)
    return torch.tensor(first, dtype=torch.long)


def _first_non_finite_row(x: torch.Tensor) -> int | None:
    """The first row of `x` [rows, cols] holding a NaN or an infinity; None when every value is finite. A NaN or an
    infinity makes the sum non-finite: one reduction answers the common case (a sum of finite values that overflows
    takes the exact path)."""
    if math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all()):
        return None
    return int((~torch.isfinite(x)).any(1).nonzero()[0].item())


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean(1).sqrt()


def _label(labels: Sequence[str] | None, row: int) -> str:
    if labels is not None and 0 <= row < len(labels):
        return labels[row]
    return f"row {row}"


def near_ties(p_truth: torch.Tensor, p_ref: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th experts are within rounding noise of swapping places.

    Judged in log-probability (logit) space, where the router's rounding is homogeneous across experts
    (every logit comes out of the same GEMM): the truth's margin log p_k - log p_(k+1) is a near-tie when
    it is at most FACTOR x 2 x the reference's largest logit error (two logits move, the layout may make
    twice the reference's error), plus 2 ulp of the k-th logit. The logit error is taken after removing
    the row's common shift (softmax's normaliser). An earlier version measured the noise in probability
    space with max |p_ref - p_truth|, which the top expert dominates: at production size (128 experts,
    bf16) it excused 62% of rows (docs/gpu.md). Returns a bool mask over rows."""
    p = p_truth.to(torch.float64)
    if p.shape[0] == 0 or top_k >= p.shape[1]:
        return torch.zeros(p.shape[0], dtype=torch.bool)
    tiny = torch.finfo(torch.float64).tiny
    lt = torch.log(p.clamp(min=tiny))
    lr = torch.log(p_ref.to(torch.float64).clamp(min=tiny))
    d = lr - lt
    d = d - d.median(dim=1, keepdim=True).values
    top = lt.topk(top_k + 1, dim=1).values
    margin = top[:, top_k - 1] - top[:, top_k]
    noise = 2 * d.abs().amax(1)
    return margin <= FACTOR * noise + 2 * ulp(top[:, top_k - 1], dtype)


def row_energy(x: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per row, the mean squared error against the float64 truth in ulps of the element's magnitude (at
    least the row's RMS: tiny elements do not blow up), as the bias test measures it."""
    t = truth.reshape(truth.shape[0], -1).to(torch.float64)
    u = element_ulp(t, dtype)
    return (((x.reshape(t.shape).to(torch.float64) - t) / u) ** 2).mean(1)


def precision_sample(sut: torch.Tensor, truth: torch.Tensor, legit: Sequence[torch.Tensor], dtype: torch.dtype,
                     leave_out: torch.Tensor | None = None, clusters: Sequence[object] | None = None) -> list[float]:
    """The precision test's evidence from one example: per token (a cluster's first row; replicas count
    once), l = log(E_sut / max over `legit` of E), over rows not in `leave_out`. Empty for full-precision
    dtypes (nothing is narrower than the reference there) and when nothing is left."""
    if torch.finfo(dtype).bits > 16 or truth.shape[0] == 0 or not legit:
        return []
    rows = truth.shape[0]
    e_sut = row_energy(sut, truth, dtype)
    e_leg = torch.stack([row_energy(x, truth, dtype) for x in legit]).amax(0)
    keep = torch.ones(rows, dtype=torch.bool) if leave_out is None else ~leave_out.to(torch.bool)
    if clusters is not None:   # a token's first replica, whether or not it is left out
        first = torch.zeros(rows, dtype=torch.bool)
        first[first_replicas(clusters, torch.arange(rows))] = True
        keep &= first
    ratio = (e_sut.clamp_min(ENERGY_FLOOR) / e_leg.clamp_min(ENERGY_FLOOR)).log()
    return [float(x) for x in ratio[keep]]


@dataclass
class PrecisionVerdict:
    ok: bool
    tokens: int
    examples: int
    mean: float = 0.0      # mean log energy ratio (0: as large as the largest legitimate error)
    z: float = 0.0
    worst: str = ""        # the example with the largest mean ratio
    reason: str = ""

    @property
    def rms_ratio(self) -> float:
        return math.exp(self.mean / 2)


class PrecisionPool:
    """The precision test across the examples of a run: `add` each example's `precision_sample`, then
    `verdict`: FAIL when the mean log energy ratio over all tokens is above 0 at z > PRECISION_Z (tokens as
    the independent units: within a token the errors share its norm's scale)."""

    def __init__(self):
        self.samples: list[tuple[str, list[float]]] = []

    def add(self, label: str, sample: Sequence[float]) -> None:
        if sample:
            self.samples.append((label, list(sample)))

    def verdict(self) -> PrecisionVerdict:
        vals = [x for _, s in self.samples for x in s]
        n = len(vals)
        v = PrecisionVerdict(True, n, len(self.samples))
        if n < BIAS_MIN_ROWS:
            v.reason = f"{n} tokens: too few to test (needs {BIAS_MIN_ROWS})"
            return v
        mean = sum(vals) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in vals) / (n - 1))
        v.mean = mean
        v.z = mean / (sd / math.sqrt(n)) if sd > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
        label, worst = max(self.samples, key=lambda ls: sum(ls[1]) / len(ls[1]))
        v.worst = f"{label} (mean ratio {sum(worst) / len(worst):+.3f} over {len(worst)} tokens)"
        if v.z > PRECISION_Z:
            v.ok = False
            v.reason = (f"precision-class excess: the target's error against the float64 truth is larger than the "
                        f"largest legitimate same-dtype error of the same tokens (reference, decoy company, the spec "
                        f"at the same layout): mean log energy ratio {mean:+.3f} (RMS error x{v.rms_ratio:.3f}; "
                        f"bound: ratio <= 0, x1.000) over {n} tokens of {v.examples} examples, z={v.z:.1f} > "
                        f"{PRECISION_Z:g}: an intermediate kept in a narrower dtype than the reference keeps it; "
                        f"largest in {v.worst}")
        return v
