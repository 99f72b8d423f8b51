"""``python -m evals signoff``: validate, plan, run every configuration (resumably), gate, report.

Exit codes: 0 PASS, 1 FAIL, 2 bad input (nothing ran), 3 an engine failed during the run (finished samples
stay cached; rerun to resume), 4 INCONCLUSIVE (a release is not signed off; --allow-inconclusive makes it 0),
130 interrupted (Ctrl-C; finished samples stay cached; rerun to resume).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpep_parity.evals import tasks
from dpep_parity.evals.data import DataError, check_data_dir, load_data
from dpep_parity.evals.engines import EngineError, engine_of
from dpep_parity.evals.matrix import MatrixError, load_matrix, resolve_models

DEFAULT_MATRIX = Path(__file__).resolve().parent / "configs" / "fixture-default.toml"
EXIT_PASS, EXIT_FAIL, EXIT_INPUT, EXIT_ENGINE, EXIT_INCONCLUSIVE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX,
                   help="configuration matrix (TOML/YAML); default: evals/configs/fixture-default.toml")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="local data in the layout of ../shared/data; default: the Hugging Face hub")
    for t in tasks.TASKS.values():   # the registered tasks (evals/tasks/): --mmlu-limit, --gsm8k-limit, ...
        p.add_argument(f"--{t.name}-limit", type=int, default=None, dest=limit_dest(t.name),
                       help=f"{t.name} items (its seeded subset); default all")
    p.add_argument("--tasks", default=",".join(tasks.names()),
                   help=f"comma-separated subset of {','.join(tasks.names())}")
    p.add_argument("--out", type=Path, default=Path("runs/signoff"), help="cache, logs and report")
    margins = ", ".join(f"{k} {v:g}" for k, v in tasks.default_margins().items())
    p.add_argument("--margin", type=float, default=None, help="equivalence margin in accuracy points for "
                   f"every measure (default: the matrix's [gate] margin, else {margins})")
    p.add_argument("--alpha", type=float, default=None, help="significance level (default 0.05)")
    p.add_argument("--aa", action="store_true",
                   help="also rerun the baseline (A/A) to measure its nondeterminism")
    p.add_argument("--seed", type=int, default=1234, help="subset seed (same seed = same documents)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="GSM8K generation budget")
    p.add_argument("--chunk-size", type=int, default=256,
                   help="samples per engine call and cache write (the serving engine batches a chunk's requests)")
    p.add_argument("--allow-inconclusive", action="store_true",
                   help="exit 0 on INCONCLUSIVE (default: 4, a release is not signed off without a decision)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-served-drift", action="store_true",
                   help="skip the served-drift probe (the same prompts under other arrival orders, DP dispatch "
                        "and concurrency, per in-process configuration: a few seconds each)")
    p.add_argument("--jobs", type=int, default=0,
                   help="runs served at once, each in a process of its own (default 0: the CPU cores when every "
                        "run's engine can share the machine, as in-process engines on CPU can; else 1)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads for in-process engines (1 is fastest for tiny models)")


def limit_dest(task: str) -> str:
    return f"{task.replace('-', '_')}_limit"


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def validate(args) -> tuple:
    """Everything that can be checked before work starts; raises MatrixError/DataError/EngineError."""

    chosen = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [t for t in chosen if t not in tasks.TASKS]
    if bad or not chosen:
        raise MatrixError([f"--tasks must name some of {', '.join(tasks.names())}, got {args.tasks!r}"])
    for t in tasks.names():
        v = getattr(args, limit_dest(t), None)
        if v is not None and v <= 0:
            raise MatrixError([f"--{t}-limit must be positive (use --tasks to skip a task)"])
    if args.max_gen_toks <= 0 or args.chunk_size <= 0:
        raise MatrixError(["--max-gen-toks and --chunk-size must be positive"])
    if args.jobs < 0:
        raise MatrixError([f"--jobs must be 0 (automatic) or positive, got {args.jobs}"])
    matrix = load_matrix(args.matrix)
    if args.margin is not None:
        if not args.margin > 0:
            raise MatrixError([f"--margin must be positive, got {args.margin}"])
        matrix.gate.margin = float(args.margin)
    if args.alpha is not None:
        if not 0 < args.alpha < 0.5:
            raise MatrixError([f"--alpha must be in (0, 0.5), got {args.alpha}"])
        matrix.gate.alpha = float(args.alpha)
    if args.data_dir is not None:
        check_data_dir(args.data_dir, chosen)
    resolve_models(matrix)
    problems = []
    for c in matrix.configs:
        try:
            problems += engine_of(c).preflight(c)
        except EngineError as e:
            problems.append(str(e))
    if problems:
        raise MatrixError(problems, matrix.path)
    return matrix, chosen


def prepare_samples(args, chosen, data):
    """Each chosen task's samples, in the registry's order."""
    from dpep_parity.evals.samples import prepare

    taskset = tasks.TaskSet(data, max_gen_toks=args.max_gen_toks)
    samples = {t: prepare(taskset, t, getattr(args, limit_dest(t), None), args.seed)
               for t in tasks.names() if t in chosen}
    return taskset, samples


def print_plan(rows, gate) -> None:
    print(f"Sample sizes before the run (alpha {gate.alpha}, power {gate.power}):")
    for r in rows:
        need = ", ".join(f"{k} flips: {v if v is not None else '> 200000'}" for k, v in r["n_needed"].items())
        mdd = ", ".join(f"{100 * v:.2f} pts at {k} flips" for k, v in r["mdd"].items())
        short = r["n_needed"]["0%"]
        warn = (f"  <- n={r['n']} cannot show equivalence within +-{100 * r['margin']:g} pts even with no flips; "
                f"use at least {short}" if short and r["n"] < short else "")
        print(f"  {r['task']:6s} n={r['n']:<6d} margin +-{100 * r['margin']:g} pts; n for PASS ({need}); "
              f"drop the difference test detects with power {gate.power:g} (Holm over {r['family']}; the "
              f"drop's own discordance counted) {mdd}{warn}")


HALF = ("bfloat16", "float16")


def truth_config(matrix, chosen):
    """The baseline served once more in float64 for the tasks' truth measures (GSM8K's reference tokens: the
    tolerance test of gsm8k-gold, gate.error_test), when the baseline is an in-process engine in half precision
    and a chosen task has a truth measure; else None."""
    base = matrix.baseline
    if (not matrix.gate.truth or not any(tasks.get(t).truth_measure for t in chosen)
            or not engine_of(base).truth or base.dtype not in HALF):
        return None
    return dataclasses.replace(base, name=f"{base.name}~float64", dtype="float64", baseline=False)


def config_row(c, keys, verdict, args, role: str | None = None) -> dict:
    """A configuration as the report lists it, with its engine's step counters over its cache `keys`."""
    from dpep_parity.evals.runner import serving_stats

    row = {"name": c.name, "layout": c.layout, "engine": c.engine, "target": engine_of(c).describe(c),
           "model": c.model_path, "dtype": c.dtype, "verdict": verdict,
           "serving": serving_stats(c, keys, args.max_gen_toks, args.out)}
    return row | ({"role": role} if role else {})


def served_drift_rows(configs) -> list[dict]:
    """Each in-process configuration's served drift (checks.serving.invariance): six prompts served as the
    sign-off serves them and under reversed arrival, shortest-queue dispatch, one running request per DP rank
    and two requests in flight, compared bitwise (prompt logits, teacher-forced log-probabilities). A target
    that promises batch and placement invariance must show none ("broken" otherwise); for any other the drift
    is information. A configuration whose probe raises is reported with the error."""
    from dpep_parity.checks.judge.invariance import claims
    from dpep_parity.checks.serving.invariance import served_drift
    from dpep_parity.checks.targets.protocol import resolve

    rows = []
    for c in configs:
        target = engine_of(c).drift_target(c)
        if target is None:
            continue
        promised = claims(resolve(target)) >= {"batch", "placement"}
        try:
            drifts = served_drift(c.model_path, c, target, c.dtype)
        except Exception as e:  # noqa: BLE001 - the probe's engine failed: reported, the configuration fails
            rows.append({"config": c.name, "promised": promised, "error": f"{type(e).__name__}: {e}"[:500],
                         "broken": True})
            continue
        rows.append({"config": c.name, "promised": promised, "broken": promised and any(d.changed for d in drifts),
                     "variants": [dataclasses.asdict(d) for d in drifts], "lines": [d.line() for d in drifts]})
    return rows


@dataclass
class SignOff:
    """What the stages of one sign-off hand on (STAGES): the validated inputs, the runs' records, the
    comparisons and verdicts, the report."""
    args: argparse.Namespace
    t0: float = field(default_factory=time.monotonic)
    matrix: Any = None
    chosen: tuple = ()
    data: Any = None
    taskset: Any = None
    samples: dict = field(default_factory=dict)
    configs: list = field(default_factory=list)      # the runs compared with the baseline (A/A rerun included)
    truth: Any = None                                # the float64 truth run, if any
    truth_todo: dict = field(default_factory=dict)
    power: dict = field(default_factory=dict)
    results: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    drift: list = field(default_factory=list)
    comparisons: list = field(default_factory=list)
    aa: list = field(default_factory=list)
    verdicts: dict = field(default_factory=dict)
    overall: str = "INCONCLUSIVE"
    code: int = EXIT_INCONCLUSIVE


def stage_inputs(s: SignOff) -> int | None:
    """Everything checkable before work: the matrix, the data, the engines, the samples."""
    if s.args.torch_threads:
        import torch

        torch.set_num_threads(s.args.torch_threads)
    try:
        s.matrix, s.chosen = validate(s.args)
        s.data = load_data(s.args.data_dir, s.chosen)
        s.taskset, s.samples = prepare_samples(s.args, s.chosen, s.data)
    except (MatrixError, DataError, EngineError) as e:
        _err(str(e))
        return EXIT_INPUT
    return None


def stage_plan(s: SignOff) -> int | None:
    """The runs (baseline first, the A/A rerun, the float64 truth run) and the pre-run power line."""
    from dpep_parity.evals import gate as G

    base, gs = s.matrix.baseline, s.matrix.gate
    s.configs = s.matrix.ordered()
    if s.args.aa:
        s.configs.insert(1, dataclasses.replace(base, name=f"{base.name}~aa", replica=1, baseline=False))
    s.truth = truth_config(s.matrix, s.chosen)
    s.truth_todo = {tasks.get(t).truth_measure: x for t, x in s.samples.items() if tasks.get(t).truth_measure}
    print(f"Sign-off: {len(s.configs)} runs ({', '.join(c.name for c in s.configs)}), data {s.data.source}, "
          + ", ".join(f"{t} {len(x)} items" for t, x in s.samples.items()))
    if s.truth:
        print(f"Truth run: {s.truth.name} (the baseline in float64, only {', '.join(s.truth_todo)}) for the "
              f"tolerance test of {', '.join(s.truth_todo)}")
    in_proc = all(engine_of(c).forced_scores for c in s.matrix.configs)   # gsm8k-gold's measure on every run
    s.power = G.planned_sizes({t: len(x) for t, x in s.samples.items()}, gs, len(s.matrix.configs) - 1,
                              tests_per_task={t: tasks.get(t).tests(in_proc, s.truth is not None)
                                              for t in s.samples})
    print_plan(s.power, gs)
    sys.stdout.flush()
    return None


def stage_serve(s: SignOff) -> int | None:
    """Every run, its finished samples cached as they come (a rerun resumes); `--jobs` runs at once, each in a
    process of its own (evals/jobs.py)."""
    from dpep_parity.evals.jobs import Interrupted, RunFailed, default_jobs, serve_runs

    runs = [(c, s.samples) for c in s.configs]
    if s.truth:
        runs.insert(1, (s.truth, s.truth_todo))
    jobs = s.args.jobs or default_jobs([c for c, _ in runs])
    if jobs > 1:
        print(f"Serving {len(runs)} runs, {min(jobs, len(runs))} at once (--jobs; each in a process of its own)")
        sys.stdout.flush()
    try:
        for name, results, seconds in serve_runs(runs, s.taskset, s.args.out, s.args.chunk_size,
                                                 not s.args.no_progress, jobs, s.args.torch_threads):
            s.results[name], s.timing[name] = results, seconds
    except Interrupted as i:
        _err(f"interrupted during configuration {', '.join(map(repr, i.names)) or '(none started)'}: finished "
             f"samples are cached in {s.args.out}; rerun the same command to resume")
        return EXIT_INTERRUPTED
    except RunFailed as f:
        if not isinstance(f.error, EngineError):
            traceback.print_exception(f.error)
        _err(f"configuration {f.name!r} failed: {type(f.error).__name__}: {f.error}\n(finished samples are "
             f"cached in {s.args.out}; rerun the same command to resume)")
        return EXIT_ENGINE
    s.timing = {c.name: s.timing[c.name] for c, _ in runs}     # the plan's order, whatever order they ended in
    return None


def stage_drift(s: SignOff) -> int | None:
    s.drift = [] if s.args.no_served_drift else served_drift_rows(s.matrix.ordered())
    return None


def stage_compare(s: SignOff) -> int | None:
    """Each run against the baseline, per task and measure, paired by document."""
    from dpep_parity.evals import gate as G

    base, gs = s.matrix.baseline, s.matrix.gate
    truth_recs = ({m: {r["doc_id"]: r for r in s.results[s.truth.name][m]} for m in s.truth_todo}
                  if s.truth else {})
    try:
        for c in s.configs[1:]:
            kind = "aa" if c.replica else "config"
            for task in s.samples:
                p = G.pair(task, s.results[base.name][task], s.results[c.name][task], base.name, c.name)
                for measure in G.measures_of(task, p):
                    tr = truth_recs.get(measure) if c.dtype == base.dtype else None
                    (s.aa if kind == "aa" else s.comparisons).append(G.compare(p, gs, kind, measure, truth=tr))
    except G.PairingError as e:
        _err(str(e))
        return EXIT_INPUT
    return None


def stage_decide(s: SignOff) -> int | None:
    """Holm over the whole family, one verdict per configuration (a broken invariance promise is a FAIL)."""
    from dpep_parity.evals import gate as G

    G.decide(s.comparisons + s.aa, s.matrix.gate)
    for c in s.matrix.ordered()[1:]:
        s.verdicts[c.name] = G.worst(x["verdict"] for x in s.comparisons if x["config"] == c.name)
    for d in s.drift:
        if d["broken"] and d["config"] in s.verdicts:     # a broken promise (or a crash) is this configuration's FAIL
            s.verdicts[d["config"]] = "FAIL"
    s.overall = G.worst(s.verdicts.values())
    s.code = {"PASS": EXIT_PASS, "FAIL": EXIT_FAIL,
              "INCONCLUSIVE": EXIT_PASS if s.args.allow_inconclusive else EXIT_INCONCLUSIVE}[s.overall]
    return None


def stage_report(s: SignOff) -> int | None:
    """signoff.{md,json,png}, and the verdicts printed."""
    import lm_eval

    from dpep_parity.evals import gate as G
    from dpep_parity.evals import report

    args, base, gs, all_cmp = s.args, s.matrix.baseline, s.matrix.gate, s.comparisons + s.aa
    aa_notes = G.aa_findings(s.aa, base.is_deterministic) if s.aa else []
    findings = [n for n in aa_notes if "DISAGREEMENT" in n]
    if len(s.matrix.configs) == 1:
        findings.append("the matrix has only the baseline: nothing was compared")
    for d in s.drift:
        if "error" in d:
            findings.append(f"SERVED-DRIFT PROBE FAILED on {d['config']}: {d['error']}")
        elif d["broken"]:
            findings.append(f"INVARIANCE PROMISE BROKEN on {d['config']} (its target promises batch and placement "
                            f"invariance): " + "; ".join(x for x in d["lines"] if not x.endswith("identical")))
    rep = {
        "verdict": s.overall, "matrix": str(args.matrix), "data_source": s.data.source, "seed": args.seed,
        "gate": {**dataclasses.asdict(gs)}, "lm_eval_version": getattr(lm_eval, "__version__", "?"),
        "baseline": base.name, "tasks": list(s.samples),
        "configs": [config_row(c, s.samples, s.verdicts.get(c.name), args) for c in s.matrix.ordered()]
        + ([config_row(s.truth, list(s.truth_todo), None, args, role="float64 truth")] if s.truth else []),
        "plan": s.power, "comparisons": all_cmp, "measures": list(dict.fromkeys(x["task"] for x in all_cmp)),
        "n_tests": len(G.family(all_cmp)),
        "aa": aa_notes, "findings": findings,
        "colleague_reports": report.find_colleague_reports(args.out),
        "timing_s": {**s.timing, "total": round(time.monotonic() - s.t0, 2)},
        "max_gen_toks": args.max_gen_toks, "served_drift": s.drift, "exit_code": s.code,
    }
    files = report.write(rep, args.out)
    print(f"\nVerdict: {s.overall}")
    for x in all_cmp:
        tag = " (A/A)" if x["kind"] == "aa" else ""
        err = x.get("error")
        print(f"  {x['config']}{tag} / {x['task']}: {x['verdict']} "
              f"(acc {100 * x['acc_base']:.2f} -> {100 * x['acc_cfg']:.2f}, "
              f"delta {100 * x['delta']:+.2f} pts"
              + (f"; error vs float64 {err['ratio']:.2f}x the baseline's, bound {err['factor']:g}x" if err else "")
              + ")")
        for r in x["reasons"]:
            print(f"    - {r}")
    for d in s.drift:
        print(f"  served drift, {d['config']}: " + (d.get("error") or "; ".join(d["lines"])))
    for n in aa_notes + [f for f in findings if f not in aa_notes]:
        print(f"  note: {n}")
    print(f"Report: {files['markdown']} ({files['json']}, {files['png']})")
    return None


# The sign-off as a pipeline: each stage reads and fills the SignOff, and returns an exit code to stop early
# (bad input, an engine failure, Ctrl-C) or None to go on. Adding a stage is one function here.
STAGES = (stage_inputs, stage_plan, stage_serve, stage_drift, stage_compare, stage_decide, stage_report)


def run(args) -> int:
    s = SignOff(args)
    for stage in STAGES:
        code = stage(s)
        if code is not None:
            return code
    return s.code
