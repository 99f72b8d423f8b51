"""The sign-off's runs served several at once, each configuration in a process of its own (`--jobs`).

An in-process configuration on CPU is a client process (lm-eval's requests, the LM adapter, the serving
engine's scheduler) and its ranks, which take turns: measured on the README's main job, one run after another
kept 141 % of the 2 cores busy and two at once 180 % (639 s -> 546 s wall; docs/evals.md, "Measured here"). Each job process gets the configuration, its samples and the task
set (lm-eval's task objects are rebuilt there: they hold lambdas), runs `runner.run_config` exactly as the
serial path does, and hands back the records; every chunk is cached by the job itself as it finishes, so a
crash or Ctrl-C loses at most the chunks in flight and a rerun resumes. The pool's processes start by spawn:
the parent has imported torch and may have started its thread pools, which a fork must not copy.

Runs go to the pool in the plan's order (baseline first). A failed run stops new runs from starting; the runs
already started finish, so their work is cached rather than thrown away, and the first failure is reported.

Written here rather than with lm-eval's own machinery: lm-eval's evaluator parallelises inside one model
(batching, accelerate's data parallel), not across the separate engines a sign-off compares.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Iterator

from dpep_parity.evals.engines import engine_of


class Interrupted(Exception):
    """Ctrl-C while serving: the configurations that were running (their finished chunks are cached)."""

    def __init__(self, names: list[str]):
        super().__init__(names)
        self.names = names


class RunFailed(Exception):
    """A configuration's run raised: its name and the exception (re-raised from the job process)."""

    def __init__(self, name: str, error: BaseException):
        super().__init__(name, error)
        self.name, self.error = name, error


def default_jobs(configs) -> int:
    """The CPU cores, when every run's engine may share this machine with another run (`Engine.concurrent`),
    else 1: a server or GPU engine runs alone."""
    if not all(engine_of(c).concurrent(c) for c in configs):
        return 1
    return max(1, min(len(configs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1))


def _slot_init(counter, threads: int | None) -> None:
    """A job process's progress-bar row (one per process, so concurrent bars do not overwrite each other)."""
    global _SLOT
    with counter.get_lock():
        _SLOT = counter.value
        counter.value += 1
    if threads:
        import torch

        torch.set_num_threads(threads)


_SLOT = 0


def _serve(config, todo, taskset, out_dir, chunk_size: int, progress: bool):
    from dpep_parity.evals.runner import run_config

    t = time.monotonic()
    results = run_config(config, todo, taskset, out_dir, chunk_size=chunk_size, progress=progress,
                         position=_SLOT)
    return results, round(time.monotonic() - t, 2)


def serve_runs(runs, taskset, out_dir: Path, chunk_size: int, progress: bool, jobs: int,
               threads: int | None = None) -> Iterator[tuple[str, dict, float]]:
    """(name, records per task, seconds) of each run as it finishes; RunFailed for the first that raised,
    Interrupted on Ctrl-C.
    `runs`: (config, samples per task). With jobs 1 every run is served here, one after another."""
    if jobs <= 1 or len(runs) <= 1:
        for config, todo in runs:
            try:
                results, seconds = _serve(config, todo, taskset, out_dir, chunk_size, progress)
            except KeyboardInterrupt:
                raise Interrupted([config.name]) from None
            except Exception as e:  # noqa: BLE001 - named and handed to the caller
                raise RunFailed(config.name, e) from e
            yield config.name, results, seconds
        return
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=ctx, initializer=_slot_init,
                               initargs=(ctx.Value("i", 0), threads))
    pending, stopped = {}, []
    try:
        pending = {pool.submit(_serve, c, todo, taskset, out_dir, chunk_size, progress): c.name for c, todo in runs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                name = pending.pop(f)
                try:
                    results, seconds = f.result()
                except KeyboardInterrupt:       # a Ctrl-C that reached the job first
                    stopped.append(name)
                    raise
                except Exception as e:  # noqa: BLE001 - the job's own exception, re-raised there
                    for other in pending:
                        other.cancel()          # runs not yet started stay unstarted; started ones finish
                    raise RunFailed(name, e) from e
                yield name, results, seconds
    except KeyboardInterrupt:
        # Ctrl-C at a terminal reaches the jobs too (one process group); one sent to this process or to one job
        # alone is passed on, so each job closes its engine and ends instead of finishing its run first
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGINT)
        raise Interrupted(stopped + [name for f, name in pending.items() if f.running()]) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
