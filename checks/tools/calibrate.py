"""Calibration of the tolerance model (checks.core.numerics): `python -m checks.tools.calibrate`.
(`--precision`: the precision test's calibration instead, checks/tools/calibrate_precision.py; `--family FIXTURE`: on a
model family's real units, checks/tools/calibrate_family.py.)

One realistic GEMM (X [m, k] @ W [k, n], inputs rounded to the dtype), its float64 truth and its
one-device result in the dtype (the reference). Three systems under test are judged by `compare`:

- split-K: the reduction over k cut into `fan_in` partials (k visited in a shuffled order), each partial
  rounded to the dtype, the partials summed in the dtype in a shuffled order: what a row-parallel linear
  followed by an all-reduce over `fan_in` ranks computes. It must pass on every row: the table's
  `split-K excess` (max over rows of err_sut / (2 err_ref + (fan_in + 1) ulp)) stays below 1.
- biased: the reference moved 1 ulp toward +inf on every element (torch.nextafter). Within the max-error
  bound, it must be caught by the bias test (|z| > BIAS_Z).
- doubled: 2x the reference (a reduction applied twice). It must fail with |sut|/|truth| ~ 2.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from dpep_parity.checks.core import numerics
from dpep_parity.progname import prog

DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SIZE = (1024, 2048, 1024)


def gemm_case(dtype: torch.dtype, seed: int, size: tuple[int, int, int] = SIZE):
    """(x, w, truth, ref): inputs in `dtype`, float64 truth of those inputs, one-device result in `dtype`."""
    m, k, n = size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(k, n, generator=g, dtype=torch.float64) / k ** 0.5).to(dtype)
    truth = x.to(torch.float64) @ w.to(torch.float64)
    return x, w, truth, x @ w


def split_k(x: torch.Tensor, w: torch.Tensor, parts: int, seed: int) -> torch.Tensor:
    """Row-parallel GEMM + all-reduce in the dtype: `parts` partials over a shuffled k, each rounded to the
    dtype (a matmul in the dtype returns the dtype), summed in the dtype in a shuffled order."""
    g = torch.Generator().manual_seed(10_000 + seed)
    perm = torch.randperm(x.shape[1], generator=g)
    partials = [x[:, idx] @ w[idx] for idx in perm.chunk(parts)]
    order = torch.randperm(parts, generator=g).tolist()
    acc = partials[order[0]]
    for i in order[1:]:
        acc = acc + partials[i]
    return acc


def biased(ref: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(ref, torch.full_like(ref, float("inf")))


def doubled(ref: torch.Tensor) -> torch.Tensor:
    return ref * 2


def measure(dtype: torch.dtype, fan_in: int, seed: int, size: tuple[int, int, int] = SIZE) -> dict:
    x, w, truth, ref = gemm_case(dtype, seed, size)
    vs = numerics.compare("split-K", split_k(x, w, fan_in, seed), truth, ref, dtype, fan_in=fan_in)
    vb = numerics.compare("biased", biased(ref), truth, ref, dtype, fan_in=fan_in)
    vd = numerics.compare("doubled", doubled(ref), truth, ref, dtype, fan_in=fan_in)
    return {"split": vs, "biased": vb, "doubled": vd}


def table(dtypes=("bfloat16", "float16", "float32"), fan_ins=(1, 2, 4, 8), seeds=(0, 1, 2),
          size: tuple[int, int, int] = SIZE, out=sys.stdout) -> list[dict]:
    rows = []
    head = (f"{'dtype':9} {'P':>2} | {'split-K excess':>14} {'bias z':>7} {'pass':>4} | "
            f"{'biased z':>9} {'ulp':>6} {'excess':>6} {'pass':>4} | "
            f"{'doubled ratio':>13} {'excess':>7} {'pass':>4}")
    print(f"GEMM {size[0]}x{size[1]} @ {size[1]}x{size[2]}, seeds {list(seeds)}; excess = max over rows of "
          f"err_sut / ({numerics.FACTOR:g} err_ref + (P+1) ulp); worst over seeds", file=out)
    print(head, file=out)
    print("-" * len(head), file=out)
    for name in dtypes:
        dt = DTYPE_NAMES[name]
        for p in fan_ins:
            ms = [measure(dt, p, s, size) for s in seeds]
            split = max((m["split"] for m in ms), key=lambda v: v.worst_excess)
            split_z = max((abs(m["split"].bias_z) for m in ms))
            bias = min((m["biased"] for m in ms), key=lambda v: abs(v.bias_z))
            dbl = max((m["doubled"] for m in ms), key=lambda v: abs(v.ratio - 2))
            row = {"dtype": name, "P": p, "split_excess": split.worst_excess, "split_bias_z": split_z,
                   "split_ok": all(m["split"].ok for m in ms),
                   "biased_z": bias.bias_z, "biased_ulp": bias.bias_ulp - bias.ref_bias_ulp,
                   "biased_excess": max(m["biased"].worst_excess for m in ms),
                   "biased_ok": any(m["biased"].ok for m in ms),
                   "doubled_ratio": dbl.ratio, "doubled_excess": min(m["doubled"].worst_excess for m in ms),
                   "doubled_ok": any(m["doubled"].ok for m in ms)}
            rows.append(row)
            print(f"{name:9} {p:>2} | {row['split_excess']:>14.3f} {row['split_bias_z']:>7.1f} "
                  f"{'yes' if row['split_ok'] else 'NO':>4} | "
                  f"{row['biased_z']:>9.1f} {row['biased_ulp']:>+6.3f} "
                  f"{row['biased_excess']:>6.3f} {'yes' if row['biased_ok'] else 'no':>4} | "
                  f"{row['doubled_ratio']:>13.4f} {row['doubled_excess']:>7.1f} "
                  f"{'yes' if row['doubled_ok'] else 'no':>4}", file=out)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.calibrate"), description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--size", type=int, nargs=3, default=list(SIZE), metavar=("M", "K", "N"))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPE_NAMES), choices=list(DTYPE_NAMES))
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the verdict and the table's rows")
    ap.add_argument("--precision", action="store_true",
                    help="calibrate the precision test instead (checks/tools/calibrate_precision.py): the spec, its "
                         "legitimate variants and the precision mutants through every unit, in bfloat16")
    ap.add_argument("--examples", type=int, default=24, help="examples per unit and target (--precision)")
    ap.add_argument("--family", metavar="FIXTURE", default=None,
                    help="calibrate on a model family's real units instead (checks/tools/calibrate_family.py): the "
                         "fixture through the sglang target at every layout, with a planted 1-ulp bias and a "
                         "doubled reduction")
    args = ap.parse_args(argv)
    if args.family:
        from dpep_parity.checks.tools import calibrate_family
        return 0 if calibrate_family.run(args.family) else 1
    if args.precision:
        from dpep_parity.checks.tools import calibrate_precision
        good, prec_rows = calibrate_precision.run(args.examples)
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump({"model_holds": good, "examples": args.examples, "rows": prec_rows}, f, indent=2)
        return 0 if good else 1
    t0 = time.perf_counter()
    rows = table(tuple(args.dtypes), seeds=tuple(range(args.seeds)), size=tuple(args.size))
    good = all(r["split_ok"] and not r["biased_ok"] and not r["doubled_ok"] for r in rows)
    print(f"{'model holds' if good else 'MODEL BROKEN'}: split-K passes on every row, biased and doubled "
          f"fail ({time.perf_counter() - t0:.1f}s)")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"model_holds": good, "size": list(args.size), "seeds": args.seeds, "rows": rows}, f, indent=2)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
