"""The GPU tier's figures (docs/gpu.md): throughput, overhead, and the tolerance model at production size.

    python -m checks.tools.bench_gpu bench     [--fixture F] [--units moe,decoder] [--sizes 1,2,4] [--examples 20]
                                               [--overlap auto|on|off] [--oracle-thread auto|on|off]
    python -m checks.tools.bench_gpu tolerance [--fixtures F,G] [--units moe,decoder] [--dtypes bfloat16]
    python -m checks.tools.bench_gpu gemm      (split-K bf16 GEMMs at the layers' shapes through cuBLAS)
    python -m checks.tools.bench_gpu judge     [--fixture F] [--units moe] [--sizes 1,4] [--examples 2] [--calls 20]
                                               [--profile]
    python -m checks.tools.bench_gpu oracle    [--fixture F] [--units moe,decoder] [--sizes 1,4] [--examples 8] [--trace N]
                                               [--oracle-thread auto|on|off]

`bench`: the spec target at 1, 2 and 4 ranks on the visible GPU(s) (one GPU: NCCL for 1 rank, gloo with
CUDA tensors for 2 and 4; `--device cpu` for the CPU tier on a tiny fixture), layout tp = dp = ep = N,
batches with idle and decoding DP ranks, any of the units moe, attention, decoder, model. Per example the
suite's wall time (as checks.judge.parity.run_example) in parts: the target's rank compute, its collectives, the
harness, the oracle's float64 truth, reference and decoy variants (computed while the ranks compute on CPU;
after them on a GPU, which the two processes would share), and the judge; against the baseline of one fused single-device forward of the same rows (transformers' layer or model in the test dtype with its
grouped-GEMM experts, all requests in one batch). Warm-up examples (builds, model loads) are not counted.

`tolerance`: per fixture, unit, layout and batch, the reference's own error (|ref - truth| in ulps of the
row's scale, and relative) next to the spec target's error against its bound, and catalog mutants
(B14 double reduction, B15 replicated shared expert) on the same examples: the spec passes, they fail.

`judge`: the judge alone (checks.judge.parity.judge, the oracle's answer cached by a first call), `--calls` times
on each of the first `--examples` benchmark batches, after one run of the ranks; with `--profile`, cProfile's top functions by
cumulative time (docs/gpu.md, third pass: profiled on the CPU with the production-size layer).

`oracle`: the oracle alone (checks.judge.parity.oracle_outputs, uncached), per example its wall time, the host's
time to queue its work before it waits for the device (`queued`) and its phases' GPU time; `--trace N`: torch.profiler
over N examples, top operators by the host's own time.

`gemm`: checks.tools.calibrate's split-K experiment on the device: one bf16 GEMM through cuBLAS (the reference)
versus the same GEMM cut over P partials, each rounded to bf16 and summed in bf16 (a row-parallel linear +
all-reduce), at the production layers' shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.nn.utils.rnn import pad_sequence

from dpep_parity.checks import units
from dpep_parity.checks.core import numerics
from dpep_parity.checks.core.batches import DTYPES, Batch, Request
from dpep_parity.checks.core.topology import Layout, validate
from dpep_parity.checks.harness import gpus
from dpep_parity.checks.harness.unitjob import CollectiveSeconds, UnitJob, load_weights
from dpep_parity.checks.harness.world import get_world
from dpep_parity.checks.judge.parity import ParityResult, judge, run_example
from dpep_parity.progname import prog


# ---------------- rank-side cache control ----------------
class EvictBuilt:
    """Rank job: drop built target modules (their weight shards live on the GPU) once this rank's CUDA
    memory passes `limit_gb`, so that many layouts of production-size layers fit on one GPU. Process
    groups stay. Returns the bytes allocated afterwards (0 on CPU)."""

    def __init__(self, limit_gb: float):
        self.limit_gb = limit_gb

    def __call__(self, ctx) -> int:
        if ctx.device != "cuda":
            return 0
        if torch.cuda.memory_allocated() > self.limit_gb * 2**30:
            for k in [k for k in ctx.cache if k[0] == "built"]:
                del ctx.cache[k]
            import gc
            gc.collect()
            torch.cuda.empty_cache()
        return int(torch.cuda.memory_allocated())


def rank_cache_limit_gb() -> float:
    return float(os.environ.get("DPEP_RANK_CACHE_GB", "10"))


def evict_if_needed(size: int, device: str, deadline_s: float = 120.0) -> None:
    if device == "cuda":
        get_world(size, device, deadline_s).run(EvictBuilt(rank_cache_limit_gb()))


# ---------------- batches ----------------
def bench_batch(dp: int, i: int) -> Batch:
    """DP rank d: extend (a 24-token request after an 8-token prefix, plus a fresh 8-token one), decode
    (8 requests), or idle, rotating with the example index so every rank is idle sometimes."""
    per = []
    for d in range(dp):
        mode = (i + d) % 3 if dp > 1 else i % 2
        if mode == 0:
            per.append((Request(8, 24), Request(0, 8)))
        elif mode == 1:
            per.append(tuple(Request(16 + j, 1) for j in range(8)))
        else:
            per.append(())
    if all(not r for r in per):
        per[0] = (Request(0, 16),)
    return Batch(tuple(per), seed=1000 + i)


def study_batches(dp: int) -> dict[str, Batch]:
    """SUM_LEN (a rank extends, one idles when dp > 1) and MAX_LEN (every rank decodes, uneven counts)."""
    ext = [(Request(4, 12), Request(0, 5))] + [() if d == 1 else (Request(6, 3),) for d in range(1, dp)]
    dec = [tuple(Request(5 + j, 1) for j in range(3 if d == 0 else 2)) for d in range(dp)]
    return {"extend+idle": Batch(tuple(ext), seed=21 + dp), "decode-only": Batch(tuple(dec), seed=41 + dp)}


# ---------------- one example, timed in parts ----------------
def timed_example(target, unit, path, layout, batch, dtype, device, deadline_s=120.0,
                  overlap: bool | None = None) -> tuple[ParityResult, dict]:
    """As checks.judge.parity.run_example (the oracle computed while the ranks compute where
    checks.judge.parity.overlaps_oracle says so, CPU ranks, or where `overlap` says; after them otherwise),
    timed in parts (seconds):
    `world` (World.run wall, the oracle inside it when overlapped), `target` (the slowest rank's job less its
    collectives), `collectives` (that rank's host time inside them), `oracle` (the oracle's whole call) and its
    phases `truth`, `reference`, `variants` (on CUDA the GPU time between events at their ends, reference.phase), `harness` (the world's wall less the slowest
    rank's job, or less the oracle when that was longer and overlapped: pickling, pipes, records), `judge` (the
    verdict, the oracle's answer at hand), `example` (the whole)."""
    from dpep_parity.checks.harness.world import RankResult
    from dpep_parity.checks.judge.parity import oracle_outputs, overlaps_oracle
    from dpep_parity.checks.oracle import reference
    config, _ = load_weights(path)
    validate(layout, config)
    res = ParityResult(unit, layout, batch, dtype)
    world = get_world(layout.tp, device, deadline_s)
    spans = {}

    def oracle():
        t = time.perf_counter()
        oracle_outputs(path, dtype, world.rank_device, None, unit, 0, batch)
        spans["oracle"] = time.perf_counter() - t

    overlap = overlaps_oracle(world) if overlap is None else overlap
    with reference.profiled() as prof:
        t0 = time.perf_counter()
        raw = world.run(CollectiveSeconds(UnitJob(target, unit, path, layout, batch, dtype, 0)),
                        meanwhile=oracle if overlap else None)
        t1 = time.perf_counter()
        if not overlap:
            oracle()
    t2 = time.perf_counter()
    results = [RankResult(r.rank, r.value[0], r.records, r.seconds) for r in raw]
    slowest = max(raw, key=lambda r: r.seconds)
    judge(res, results, config, path, 0, device=world.rank_device)
    t3 = time.perf_counter()
    busy = max(slowest.seconds, spans["oracle"]) if overlap else slowest.seconds
    parts = dict(world=t1 - t0, target=slowest.seconds - slowest.value[1], collectives=slowest.value[1],
                 harness=max(0.0, (t1 - t0) - busy), truth=prof.get("truth", 0.0),
                 reference=prof.get("reference", 0.0), variants=prof.get("variants", 0.0),
                 oracle=spans["oracle"], judge=t3 - t2, example=t3 - t0)
    return res, parts, world


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _fused_experts() -> str:
    from dpep_parity.checks.oracle.oracle_experts import grouped_available
    return "grouped_mm" if grouped_available() else "eager"


@torch.no_grad()
def fused_forward_s(path: str, unit: str, batch: Batch, dtype: str, device: str, repeats: int = 3) -> float:
    """The baseline: the same rows through one single-device forward, as an engine's one GPU would run them:
    transformers' layer (or model) in the test dtype with its fused grouped-GEMM experts (`grouped_mm`), every
    request in one right-padded batch (a causal mask keeps requests apart), CUDA-synchronized; median of
    `repeats` after one warm call."""
    from dpep_parity.checks.oracle.reference import _causal_mask, load_model
    model = load_model(path, dtype, device, _fused_experts())
    dt = DTYPES[dtype]
    u = units.get(unit)
    config, _ = load_weights(path)
    seqs = u.global_inputs(batch, config, dt)
    if u.takes == "tokens":
        ids = pad_sequence(seqs, batch_first=True).to(device)

        def call():
            model(input_ids=ids)
    elif u.takes == "rows":
        x = seqs[0][None].to(device)
        mlp = model.model.layers[0].mlp

        def call():
            mlp(x)
    else:
        h = pad_sequence(seqs, batch_first=True).to(device)
        longest = h.shape[1]
        pe = model.model.rotary_emb(h, torch.arange(longest, device=device)[None].expand(h.shape[0], -1))
        mask = _causal_mask(longest, dt, device)
        layer = model.model.layers[0]

        def call():
            if unit == "attention":
                layer.self_attn(hidden_states=layer.input_layernorm(h), position_embeddings=pe, attention_mask=mask)
            else:
                layer(h, attention_mask=mask, position_embeddings=pe)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


PARTS = ("target", "collectives", "harness", "truth", "reference", "variants", "judge")


def cmd_bench(a) -> int:
    from dpep_parity.checks.oracle import oracle_experts
    from dpep_parity.fixtures.build import fixture_path
    path = str(fixture_path(a.fixture))
    rows = []
    dt = DTYPES[a.dtype]
    overlap = {"auto": None, "on": True, "off": False}[a.overlap]
    print(f"# bench: spec target, {a.fixture}, {a.dtype}, device {a.device}, {a.examples} examples after "
          f"{a.warmup} warm-up; medians per example, ms. Oracle: truth experts {oracle_experts.truth_experts()}, "
          f"reference experts {oracle_experts.reference_experts(dt, a.device)}; fused = one single-device forward "
          f"of the same rows, experts {_fused_experts()}; oracle beside the ranks: {a.overlap} (MPS daemon: "
          f"{gpus.mps_daemon() or 'none'}); oracle's worker thread (CUDA): {_oracle_thread_mode()}", flush=True)
    print("| unit | ranks | backend | examples/s | example ms | " + " | ".join(f"{p} ms" for p in PARTS)
          + " | oracle ms | fused ms | oracle / fused | example / fused | rows | pass |")
    print("|" + "---|" * (len(PARTS) + 11))
    for unit in a.units.split(","):
        for n in map(int, a.sizes.split(",")):
            lay = Layout(n, n, n)
            batches = [bench_batch(n, i) for i in range(a.warmup + a.examples)]
            evict_if_needed(n, a.device)
            for b in batches[: a.warmup]:
                timed_example("spec", unit, path, lay, b, a.dtype, a.device, overlap=overlap)
            parts, fused, ok = [], [], 0
            t_all = time.perf_counter()
            for b in batches[a.warmup:]:
                res, part, world = timed_example("spec", unit, path, lay, b, a.dtype, a.device, overlap=overlap)
                parts.append(part)
                ok += res.ok
                if not res.ok:
                    print(res.report(), file=sys.stderr)
            eps = a.examples / (time.perf_counter() - t_all)
            for b in batches[a.warmup:]:
                fused.append(fused_forward_s(path, unit, b, a.dtype, a.device))
            med = statistics.median
            row = dict(unit=unit, ranks=n, backend=world.backend, examples_per_s=eps,
                       **{f"{k}_ms": 1e3 * med(p[k] for p in parts) for k in (*PARTS, "oracle", "example", "world")},
                       fused_ms=1e3 * med(fused),
                       rows=med(sum(b.tokens_per_dp()) for b in batches[a.warmup:]), passed=ok, of=a.examples)
            row["oracle_over_fused"] = row["oracle_ms"] / row["fused_ms"]
            row["example_over_fused"] = row["example_ms"] / row["fused_ms"]
            rows.append(row)
            print(f"| {unit} | {n} | {row['backend']} | {eps:.1f} | {row['example_ms']:.1f} | "
                  + " | ".join(f"{row[f'{p}_ms']:.1f}" for p in PARTS)
                  + f" | {row['oracle_ms']:.1f} | {row['fused_ms']:.2f} | {row['oracle_over_fused']:.1f}x | "
                  f"{row['example_over_fused']:.0f}x | {row['rows']:.0f} | {ok}/{a.examples} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["passed"] == r["of"] for r in rows) else 1


def cmd_judge(a) -> int:
    import cProfile
    import pstats

    from dpep_parity.fixtures.build import fixture_path
    path = str(fixture_path(a.fixture))
    config, _ = load_weights(path)
    print(f"# judge alone: spec target, {a.fixture}, {a.dtype}, device {a.device}, median of {a.calls} calls")
    print("| unit | ranks | example | rows | judge ms | pass |\n|---|---|---|---|---|---|")
    prof = cProfile.Profile() if a.profile else None
    for unit in a.units.split(","):
        for n in map(int, a.sizes.split(",")):
            lay = Layout(n, n, n)
            world = get_world(n, a.device, 120.0)
            for i in range(a.examples):
                b = bench_batch(n, i)
                results = world.run(UnitJob("spec", unit, path, lay, b, a.dtype, 0))
                judge(ParityResult(unit, lay, b, a.dtype), results, config, path, 0, device=world.rank_device)
                times = []              # the oracle's answer is cached from the call above: the judge alone
                for _ in range(a.calls):
                    r = ParityResult(unit, lay, b, a.dtype)
                    t = time.perf_counter()
                    if prof:
                        prof.enable()
                    judge(r, results, config, path, 0, device=world.rank_device)
                    if prof:
                        prof.disable()
                    times.append(time.perf_counter() - t)
                print(f"| {unit} | {n} | {i} | {sum(b.tokens_per_dp())} | {1e3 * statistics.median(times):.2f} | "
                      f"{'yes' if r.ok else 'NO'} |", flush=True)
    if prof:
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    return 0


def _oracle_thread_mode() -> str:
    """Whether Oracles made now on CUDA put the truth and the reference in their worker thread ('on' / 'off')."""
    from dpep_parity.checks.oracle import reference
    return "on" if (gpus.oracle_thread() if reference.THREADED is None else reference.THREADED) else "off"


def cmd_oracle(a) -> int:
    """The oracle alone, uncached, one process: per example its wall time, the host's time to queue it (`queued`:
    where that is close to the wall, the oracle is bound by the CPU that launches its kernels, not by the GPU),
    and the GPU time of its phases; with `--trace`, torch.profiler's top operators by the host's own time."""
    from dpep_parity.checks.judge.parity import oracle_outputs
    from dpep_parity.checks.oracle import reference
    from dpep_parity.fixtures.build import fixture_path
    path = str(fixture_path(a.fixture))
    uncached = oracle_outputs.__wrapped__
    print(f"# oracle alone: {a.fixture}, {a.dtype}, device {a.device}, {a.examples} examples after "
          f"{a.warmup} warm-up; medians, ms; worker thread (CUDA): {_oracle_thread_mode()}")
    print("| unit | ranks | rows | wall ms | queued ms | truth ms | reference ms | variants ms |\n"
          "|---|---|---|---|---|---|---|---|")
    rows = []
    for unit in a.units.split(","):
        for n in map(int, a.sizes.split(",")):
            batches = [bench_batch(n, i) for i in range(a.warmup + a.examples)]
            for b in batches[: a.warmup]:
                uncached(path, a.dtype, a.device, None, unit, 0, b)
            parts = []
            for b in batches[a.warmup:]:
                with reference.profiled() as prof:
                    t = time.perf_counter()
                    uncached(path, a.dtype, a.device, None, unit, 0, b)
                parts.append(dict(prof, wall=time.perf_counter() - t))
            med = {k: 1e3 * statistics.median(p.get(k, 0.0) for p in parts)
                   for k in ("wall", "queued", "truth", "reference", "variants")}
            rows.append(dict(unit=unit, ranks=n, rows=sum(batches[-1].tokens_per_dp()), **med))
            print(f"| {unit} | {n} | {rows[-1]['rows']} | " + " | ".join(f"{v:.2f}" for v in med.values()) + " |",
                  flush=True)
            if a.trace:
                from torch.profiler import ProfilerActivity, profile
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
                with profile(activities=acts) as p:
                    for b in batches[a.warmup: a.warmup + a.trace]:
                        uncached(path, a.dtype, a.device, None, unit, 0, b)
                print(f"\n{unit} at {n} ranks' batches, {a.trace} examples:\n```")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
                print("```", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


# ---------------- tolerance study ----------------
def ref_error(path: str, unit: str, batch: Batch, dtype: str, device: str) -> dict:
    """The reference's own error against the truth, on the same rows the judge uses."""
    from dpep_parity.checks.oracle.reference import Oracle
    config, _ = load_weights(path)
    dt = DTYPES[dtype]
    o = Oracle(path, dtype, device)
    unit_ = units.get(unit)
    u = unit_.reference(o, 0, batch, unit_.global_inputs(batch, config, dt))
    t, r = u.truth, u.ref.to(torch.float64)
    scale = torch.maximum(t.abs(), t.pow(2).mean(1, keepdim=True).sqrt())
    ulps = (r - t).abs() / numerics.ulp(scale, dt)
    ties = sharp = 0
    if u.router:
        top_k = config.get("num_experts_per_tok", 1)
        for pt, pr in zip(u.router[0][0], u.router[0][1]):
            ties += int(numerics.near_ties(pt, pr, top_k, dt).sum())
            sharp += int(sharp_ties(pt, pr, top_k, dt).sum())
    e_row = (r - t).abs().amax(1)
    floor = numerics.ulp(t.abs().amax(1), dt)
    return dict(ref_max_ulp=float(ulps.max()), ref_mean_ulp=float(ulps.mean()),
                ref_rel=float((r - t).norm() / t.norm()),
                ref_vs_ulp=float((numerics.FACTOR * e_row / floor).median()),
                tie_rows=ties, sharp_tie_rows=sharp, rows=t.shape[0])


def sharp_ties(p_truth, p_ref, top_k, dtype):
    """For comparison only (not used by the judge): near-ties with the noise measured at the two
    probabilities that decide the k-th slot (truth's k-th and (k+1)-th experts) instead of the row's
    largest probability error, which the top expert dominates."""
    p = p_truth.to(torch.float64)
    if p.shape[0] == 0 or top_k >= p.shape[1]:
        return torch.zeros(p.shape[0], dtype=torch.bool)
    top = p.topk(top_k + 1, dim=1)
    err = (p_ref.to(torch.float64) - p).abs().gather(1, top.indices[:, top_k - 1: top_k + 1]).amax(1)
    margin = top.values[:, top_k - 1] - top.values[:, top_k]
    return margin <= numerics.FACTOR * 2 * err + 2 * numerics.ulp(top.values[:, top_k - 1], dtype)


STUDY_LAYOUTS = ((1, 1, 1), (2, 1, 1), (2, 2, 2), (4, 1, 1), (4, 2, 2), (4, 4, 4))


def cmd_tolerance(a) -> int:
    from dpep_parity.checks.catalog.mutants import CATALOG
    from dpep_parity.fixtures.build import fixture_path
    print(f"# tolerance: device {a.device}, cuBLAS bf16 reduced-precision reduction "
          f"{torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction if a.device == 'cuda' else 'n/a'}, "
          f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32 if a.device == 'cuda' else 'n/a'}", flush=True)
    print("ref = the reference's own error vs float64 truth (max / mean ulp of the row's scale, relative "
          "Frobenius); 2err_ref/ulp = median over rows of 2 x the reference's row error in ulps of the row's "
          "max (the bound's first term against one ulp); excess = worst row's err / bound (>1 fails)")
    print("| fixture | unit | dtype | layout | batch | rows | tie rows (judge / sharp) | ref max ulp | ref mean ulp | ref rel | "
          "2err_ref/ulp | spec excess | spec | " + " | ".join(f"{m} excess, |sut|/|truth|" for m in a.mutants.split(","))
          + " |")
    print("|" + "---|" * (13 + len(a.mutants.split(","))))
    bad = 0
    records = []
    for fx in a.fixtures.split(","):
        path = str(fixture_path(fx))
        config, _ = load_weights(path)
        for unit in a.units.split(","):
            for dtype in a.dtypes.split(","):
                for tp, dp, ep in STUDY_LAYOUTS:
                    lay = Layout(tp, dp, ep)
                    if tp not in a.sizes_list:
                        continue
                    for bname, batch in study_batches(dp).items():
                        evict_if_needed(tp, a.device)
                        res = run_example("spec", unit, path, lay, batch, dtype, 0, a.device)
                        ref = ref_error(path, unit, batch, dtype, a.device)
                        v = res.verdict
                        bad += not res.ok
                        rec = dict(fixture=fx, unit=unit, dtype=dtype, layout=str(lay), batch=bname, **ref,
                                   spec_ok=res.ok, spec_excess=v.worst_excess if v else None, mutants={})
                        cells = []
                        for mid in a.mutants.split(","):
                            if tp == 1 or (mid == "B15" and not config.get("shared_expert_intermediate_size")) \
                                    or (mid == "B14" and dp == 1):
                                cells.append("n/a")   # B14 needs the DP path (dp > 1); B15 a shared expert
                                continue
                            mres = run_example(f"checks.catalog.mutants:{mid}", unit, path, lay, batch, dtype, 0, a.device)
                            mv = mres.verdict
                            killed = not mres.ok
                            rec["mutants"][mid] = dict(killed=killed, excess=mv.worst_excess if mv else None,
                                                       ratio=mv.ratio if mv else None,
                                                       failed=[c.prop for c in mres.failures()])
                            cells.append(("KILLED " if killed else "survived ") +
                                         (f"{mv.worst_excess:.1f}, {mv.ratio:.3f}" if mv else
                                          ",".join(c.prop for c in mres.failures())))
                        records.append(rec)
                        print(f"| {fx} | {unit} | {dtype} | {lay} | {bname} | {ref['rows']} | "
                              f"{ref['tie_rows']} / {ref['sharp_tie_rows']} | "
                              f"{ref['ref_max_ulp']:.1f} | {ref['ref_mean_ulp']:.2f} | {ref['ref_rel']:.2e} | "
                              f"{ref['ref_vs_ulp']:.1f} | {v.worst_excess if v else float('nan'):.2f} | "
                              f"{'PASS' if res.ok else 'FAIL'} | " + " | ".join(cells) + " |", flush=True)
                        if not res.ok:
                            print(res.report(), file=sys.stderr)
    _ = CATALOG
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if bad else 0


# ---------------- split-K GEMMs through cuBLAS ----------------
GEMM_SHAPES = {   # (m, k, n): rows x reduction x outputs
    "qwen3 expert down": (256, 768, 2048),
    "qwen3 o_proj": (256, 4096, 2048),
    "qwen2 expert down": (256, 2560, 3584),
    "qwen2 shared down": (256, 20480, 3584),
}


def cmd_gemm(a) -> int:
    from dpep_parity.checks.tools.calibrate import biased, doubled, split_k
    dev = a.device
    print(f"# split-K on {dev}: excess = max over rows of err_sut / (2 err_ref + (P+1) ulp); worst of "
          f"{a.seeds} seeds; bf16 reduced-precision reduction "
          f"{torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction if dev == 'cuda' else 'n/a'}")
    print("| GEMM (m x k x n) | P | ref max ulp | split-K excess | split-K | doubled | biased z |")
    print("|---|---|---|---|---|---|---|")
    dt = torch.bfloat16
    good = True
    for name, (m, k, n) in GEMM_SHAPES.items():
        for p in (2, 4, 8):
            ex, ok, dbl, bz, rmax = 0.0, True, True, 0.0, 0.0
            for seed in range(a.seeds):
                g = torch.Generator().manual_seed(seed)   # as checks.tools.calibrate.gemm_case, computed on `dev`
                x = torch.randn(m, k, generator=g, dtype=torch.float64).to(dt).to(dev)
                w = (torch.randn(k, n, generator=g, dtype=torch.float64) / k ** 0.5).to(dt).to(dev)
                truth = (x.double() @ w.double()).cpu()
                ref = (x @ w).cpu()
                sut = split_k(x, w, p, seed).cpu()
                vs = numerics.compare("split", sut, truth, ref, dt, fan_in=p)
                vd = numerics.compare("doubled", doubled(ref), truth, ref, dt, fan_in=p)
                vb = numerics.compare("biased", biased(ref), truth, ref, dt, fan_in=p)
                u = numerics.ulp(torch.maximum(truth.abs(), truth.pow(2).mean(1, keepdim=True).sqrt()), dt)
                rmax = max(rmax, float(((ref.double() - truth).abs() / u).max()))
                ex, ok = max(ex, vs.worst_excess), ok and vs.ok
                dbl = dbl and not vd.ok
                bz = max(bz, abs(vb.bias_z))
            good = good and ok and dbl
            print(f"| {name} {m}x{k}x{n} | {p} | {rmax:.1f} | {ex:.3f} | {'pass' if ok else 'FAIL'} | "
                  f"{'fails' if dbl else 'PASSES'} | {bz:.1f} |", flush=True)
    return 0 if good else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.bench_gpu"), description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--units", default="moe,decoder")
    b.add_argument("--sizes", default="1,2,4")
    b.add_argument("--examples", type=int, default=20)
    b.add_argument("--warmup", type=int, default=2)
    b.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="the oracle computed while the ranks compute: auto decides as the suite does (CPU ranks, or GPU "
                        "ranks where an MPS daemon listens); on; off. On one GPU, on pays only where the GPU runs both "
                        "processes' kernels at once (MPS)")
    t = sub.add_parser("tolerance")
    t.add_argument("--fixtures", default="qwen3-30b-a3b-layer,qwen2-57b-a14b-layer-e16")
    t.add_argument("--units", default="moe,decoder")
    t.add_argument("--dtypes", default="bfloat16")
    t.add_argument("--sizes", default="1,2,4")
    t.add_argument("--mutants", default="B14,B15")
    g = sub.add_parser("gemm")
    g.add_argument("--seeds", type=int, default=2)
    j = sub.add_parser("judge")
    j.add_argument("--units", default="moe")
    j.add_argument("--sizes", default="1,4")
    j.add_argument("--examples", type=int, default=2)
    j.add_argument("--calls", type=int, default=20)
    j.add_argument("--profile", action="store_true")
    o = sub.add_parser("oracle")
    o.add_argument("--units", default="moe,decoder")
    o.add_argument("--sizes", default="1,4")
    o.add_argument("--examples", type=int, default=8)
    o.add_argument("--warmup", type=int, default=2)
    o.add_argument("--trace", type=int, default=0, help="examples to trace with torch.profiler (0: none)")
    for p in (b, o):
        p.add_argument("--oracle-thread", choices=("auto", "on", "off"), default="auto",
                       help="on CUDA, the oracle's truth and reference queued by a worker thread while the decoys are "
                            "queued (checks.oracle.reference.Oracle.answer: on), or all in one thread (off); auto: as "
                            "the suite decides (DPEP_ORACLE_THREAD)")
    for p in (b, j, o):         # one example's fixture and dtype: the benchmark's, the judge's, the oracle's
        p.add_argument("--fixture", default="qwen3-30b-a3b-layer")
        p.add_argument("--dtype", default="bfloat16")
    for p in (b, t, g, j, o):
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.cmd == "tolerance":
        a.sizes_list = tuple(int(s) for s in a.sizes.split(","))
    import warnings
    warnings.filterwarnings("ignore")
    gpus.limit_controller_threads(a.device)
    if getattr(a, "oracle_thread", "auto") != "auto":
        from dpep_parity.checks.oracle import reference
        reference.THREADED = a.oracle_thread == "on"
    return {"bench": cmd_bench, "tolerance": cmd_tolerance, "gemm": cmd_gemm, "judge": cmd_judge,
            "oracle": cmd_oracle}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
