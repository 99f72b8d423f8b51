"""Which documents run (each task's seeded subset), their lm-eval requests, and one engine call per chunk.

Every configuration sees exactly the same documents and prompts: the subset depends only on the data, the
limit and the seed; each sample carries a sha256 of its exact requests and target. What a task selects,
builds and scores is the task object's (evals/tasks/<name>.py); this module only dispatches through the
registry.
"""
from __future__ import annotations

from dpep_parity.evals import tasks
from dpep_parity.evals.tasks import TaskSet
from dpep_parity.evals.tasks.base import DEFAULT_SEED, Sample, allocate  # noqa: F401  (re-exported)


def prepare(taskset: TaskSet, name: str, limit: int | None, seed: int = DEFAULT_SEED) -> list[Sample]:
    """Task `name`'s samples: its seeded subset of `limit` documents (None: all), with their requests."""
    task = tasks.get(name)
    return task.build(taskset, task.select(taskset, limit, seed))


def run_chunk(lm, taskset: TaskSet, key: str, chunk: list[Sample]) -> list[dict]:
    """One engine call for a chunk of samples; returns their scored records. `key` is a task's name, or a
    task's truth measure (the float64 truth run: "gsm8k-gold" teacher-forces GSM8K's reference solutions)."""
    return tasks.runner_of(key)(lm, taskset, chunk)
