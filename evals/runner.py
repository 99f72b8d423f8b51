"""Run one configuration over the samples, resuming from its per-sample cache.

The engine (or server) is opened only if some sample is missing from the cache, and always closed.
Samples run in chunks; each finished chunk is appended to the cache (fsynced) before the next starts,
so a kill loses at most the chunk in flight.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from tqdm import tqdm

from dpep_parity.evals.cache import SampleCache, ServingStats, fingerprint
from dpep_parity.evals.engines import open_lm
from dpep_parity.evals.samples import Sample, run_chunk
from dpep_parity.evals.tasks import TaskSet


def run_config(config, samples: dict[str, list[Sample]], taskset: TaskSet, out_dir: Path,
               chunk_size: int = 8, progress: bool = True, opener=open_lm,
               position: int = 0) -> dict[str, list[dict]]:
    fp = fingerprint(config, taskset.max_gen_toks)
    results: dict[str, list[dict]] = {}
    with contextlib.ExitStack() as stack:
        lm = None
        for task, task_samples in samples.items():
            cache = SampleCache(out_dir, config.name, task, fp)
            missing = [s for s in task_samples if cache.get(s.doc_id, s.prompt_hash) is None]
            bar = tqdm(total=len(task_samples), initial=len(task_samples) - len(missing), unit="doc",
                       desc=f"{config.name} {task}", file=sys.stderr, disable=not progress,
                       dynamic_ncols=True, leave=True, position=position)
            stats = ServingStats(out_dir, config.name, task, fp)
            with bar:
                for i in range(0, len(missing), chunk_size):
                    if lm is None:
                        lm = stack.enter_context(opener(config, taskset.max_gen_toks, Path(out_dir) / "logs"))
                    chunk = missing[i:i + chunk_size]
                    before = engine_stats(lm)
                    cache.append(run_chunk(lm, taskset, task, chunk))
                    stats.add({k: v - before.get(k, 0) for k, v in engine_stats(lm).items()})
                    bar.update(len(chunk))
            results[task] = [cache.get(s.doc_id, s.prompt_hash) for s in task_samples]
    return results


def engine_stats(lm) -> dict[str, int]:
    """The step counters of an in-process serving engine behind `lm` (none for server engines)."""
    return dict(getattr(getattr(lm, "engine", None), "stats", None) or {})


def serving_stats(config, tasks, max_gen_toks: int, out_dir: Path) -> dict[str, int]:
    """A configuration's step counters summed over its tasks (empty when its engine has none)."""
    fp = fingerprint(config, max_gen_toks)
    total: dict[str, int] = {}
    for task in tasks:
        for k, v in ServingStats(out_dir, config.name, task, fp).load().items():
            total[k] = total.get(k, 0) + v
    return total
