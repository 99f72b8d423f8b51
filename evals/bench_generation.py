"""GSM8K generation throughput of the in-process engine, per layout: documents per second through the
sign-off's own path (lm-eval requests -> the LM adapter -> the engine), greedy, with the task's stop sequences.

    python -m evals.bench_generation --data-dir ../shared/data --docs 8 --layouts tp1,tp2-dp2,tp4-dp4-ep4

Prints one line per layout and, with --json, writes the figures. docs/evals.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.bench_generation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--model", default="fixture:qwen2-moe-shared")
    ap.add_argument("--target", default="spec")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--layouts", default="tp1,tp2-dp2,tp4-dp4-ep4")
    ap.add_argument("--max-running", type=int, default=None, help="requests resident per DP rank (serving engine)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    import torch

    from dpep_parity.checks.core.topology import Layout
    from dpep_parity.evals.data import load_data
    from dpep_parity.evals.engines import open_lm
    from dpep_parity.evals.matrix import Config, resolve_model
    from dpep_parity.evals.samples import prepare
    from dpep_parity.evals.tasks import TaskSet

    torch.set_num_threads(1)
    data = load_data(a.data_dir, ("gsm8k",))
    taskset = TaskSet(data, max_gen_toks=a.max_gen_toks)
    samples = prepare(taskset, "gsm8k", a.docs)
    model = resolve_model(a.model, "inproc", None)
    rows = []
    for name in a.layouts.split(","):
        lay = Layout.parse(name)
        cfg = Config.make(name=name, tp=lay.tp, dp=lay.dp, ep=lay.ep, model=a.model, dtype=a.dtype,
                     target=a.target, model_path=model,
                     **({"max_running": a.max_running} if a.max_running else {}))
        with open_lm(cfg, a.max_gen_toks, Path("runs/bench-logs")) as lm:
            lm.generate_until([samples[0].instances[0]], disable_tqdm=True)     # world start-up, warm caches
            t0 = time.perf_counter()
            gens = lm.generate_until([s.instances[0] for s in samples], disable_tqdm=True)
            dt = time.perf_counter() - t0
        tokens = sum(len(lm.tok_encode(g)) for g in gens)
        rows.append({"layout": name, "docs": len(samples), "seconds": round(dt, 2),
                     "docs_per_s": round(len(samples) / dt, 3), "generated_tokens": tokens})
        print(f"{name:14s} {len(samples)} docs in {dt:7.1f} s: {len(samples) / dt:7.3f} docs/s "
              f"({tokens} tokens generated)", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
