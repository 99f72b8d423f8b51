"""What an eval task is: the :class:`EvalTask` and :class:`Measure` objects the registry holds, and the helpers
task modules share (lm-eval task construction, seeded subsets, request hashes, lm-eval's evaluator per chunk).

Task modules import only this module (never the package's ``__init__``, which discovers them).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import logging
import random
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

import yaml

from dpep_parity.evals.cache import sha256_json

HERE = Path(__file__).resolve().parent
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed
DEFAULT_SEED = 1234  # the subset seed (--seed)


class PairingError(ValueError):
    """Two runs cannot be paired: different documents or different prompts."""


@dataclass
class Sample:
    task: str                 # the task's name ("mmlu", "gsm8k", ...)
    doc_id: str               # "<task>/<...>/<index>" (index: lm-eval's doc_id in the task's test docs)
    index: int
    subject: str | None       # the cluster of the task's items when they have one (MMLU: the subject)
    doc: dict
    prompt: str
    instances: list = field(repr=False)
    prompt_hash: str = ""
    lm_task: str = ""         # the lm-eval task's name (config.task) that built the requests


@dataclass(frozen=True)
class Measure:
    """A paired binary outcome per unit, units grouped in clusters: what the gate compares.

    outcomes(p, gate) -> (baseline outcomes, configuration outcomes, cluster of each unit) as arrays;
    agreement(p) -> (fraction, what it counts); drift(p) -> {mean_abs_chosen, max_abs_chosen,
    max_abs_any_choice} or None; answers(p) -> (baseline answer indices, configuration's) for the answer-symmetry
    test, or None when the measure has no answer letters."""

    name: str
    margin: float                    # default equivalence margin, accuracy points (docs/evals.md, "Margins")
    unit: str                        # "item" | "token"
    cluster: str | None              # what clusters its units ("subject", "document"); None: independent
    outcomes: Callable
    agreement: Callable
    drift: Callable = lambda p: None
    answers: Callable | None = None  # set: the gate also runs the answer-symmetry test (one more test)
    tolerance: bool = False          # the gate runs the tolerance test against the float64 truth run (one more)
    title: str = ""                  # the report's heading note


class EvalTask:
    """One eval task: subclass it in a module of this package that sets ``TASK = MyTask()``; the registry
    (``evals/tasks/__init__.py``) finds it, and the data loader, sign-off, gate, matrix and report consult it.

    Class attributes: ``name``; ``splits`` (local files ``DIR/<name>/<split>.jsonl``, the first is the one whose
    documents are evaluated); ``measures`` (its :class:`Measure` objects, the first the task's own);
    ``truth_measure`` (a measure the float64 truth run records, or None); ``order``."""

    name: str = ""
    splits: tuple[str, ...] = ("test",)
    measures: tuple[Measure, ...] = ()
    truth_measure: str | None = None
    order: int = 100                 # where it is listed (the default --tasks, the run, the report): low first

    # ----------------------------------------------------------------------------- data
    def check_row(self, row: object, where: str) -> None:
        """Raise evals.data.DataError naming `where` (file:line) when a row is malformed."""

    def check_splits(self, splits: dict[str, list[dict]], origin: str) -> None:
        """Checks across rows (after every row passed check_row)."""

    def load_hub(self) -> dict[str, list[dict]]:
        raise NotImplementedError(f"task {self.name!r} has no hub loader: pass --data-dir")

    # ----------------------------------------------------------------------------- lm-eval
    def lm_eval_task(self, taskset, *key):
        """The lm-eval ConfigurableTask (cached by the TaskSet per key)."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- documents and requests
    def select(self, taskset, limit: int | None, seed: int = DEFAULT_SEED) -> list:
        """The documents to run: depends only on the data, the limit and the seed (paired by construction)."""
        raise NotImplementedError

    def build(self, taskset, selection: list) -> list[Sample]:
        raise NotImplementedError

    def run(self, lm, taskset, chunk: list[Sample]) -> list[dict]:
        """One engine call for a chunk of samples: their scored, paired per-document records."""
        raise NotImplementedError

    def run_truth(self, lm, taskset, chunk: list[Sample]) -> list[dict]:
        """The float64 truth run's records of `truth_measure`."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- gate
    def measures_of(self, p) -> list[str]:
        """The measures both runs' paired records support (default: the task's own)."""
        return [self.measures[0].name]

    def tests(self, in_process: bool, truth: bool) -> int:
        """Tests this task adds to the gate's family per configuration (Holm's multiplicity correction), as
        planned before the run: its measures' difference tests, plus their symmetry and tolerance tests."""
        return sum(1 + (m.answers is not None) for m in self.measures)


# --------------------------------------------------------------------------------- lm-eval task helpers
@cache
def task_yaml(name: str) -> dict:
    return yaml.safe_load((HERE / f"{name}.yaml").read_text())


def config_from_yaml(name: str, **overrides) -> dict:
    return copy.deepcopy(task_yaml(name)) | overrides


def doc_seed(doc_index: int, seed: int = FEWSHOT_SEED) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_index}".encode()).digest()[:8], "big")


def quiet_lm_eval() -> None:
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    compiled_templates()


def compiled_templates() -> None:
    """lm-eval renders every prompt field with `lm_eval.utils.apply_template`, which compiles its Jinja template
    on every call (`env.from_string`; Jinja caches only templates that come through a loader). A field's template
    is one of a handful of strings per task, yet each compile costs about 4 ms: measured on the 2-core machine,
    22.7 s of an 85 s two-configuration MMLU sign-off of 256 documents (cProfile of `python -m evals signoff`),
    since the evaluator renders every document again for each configuration. Swap lm-eval's public module
    environment for one that keeps compiled templates (same loader, filters, undefined and newline settings,
    so the rendered text is identical: the prompt hashes in the cache prove it). Idempotent."""
    from lm_eval import utils

    cls = _template_cache_class()
    if isinstance(utils.env, cls):
        return
    env = cls(loader=utils.env.loader, undefined=utils.env.undefined,
              keep_trailing_newline=utils.env.keep_trailing_newline)
    env.filters.update(utils.env.filters)
    utils.env = env


@cache
def _template_cache_class():
    import jinja2

    class TemplateCache(jinja2.Environment):
        """A Jinja environment whose `from_string` keeps what it compiled (plain-string sources only)."""

        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self._compiled: dict[str, jinja2.Template] = {}

        def from_string(self, source, globals=None, template_class=None):
            if globals is not None or template_class is not None or not isinstance(source, str):
                return super().from_string(source, globals, template_class)
            if source not in self._compiled:
                if len(self._compiled) >= 4096:
                    self._compiled.clear()
                self._compiled[source] = super().from_string(source)
            return self._compiled[source]

    return TemplateCache


def dataset_dict(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def configurable_task(cfg: dict, splits: dict[str, list[dict]]):
    """lm-eval's ConfigurableTask for `cfg`, over already-validated rows (its `custom_dataset` hook)."""
    from lm_eval.api.task import ConfigurableTask

    quiet_lm_eval()
    return ConfigurableTask(config=dict(cfg, custom_dataset=lambda **_: dataset_dict(splits)))


# --------------------------------------------------------------------------------- subsets and requests
def allocate(sizes: dict[str, int], limit: int, seed: int) -> dict[str, int]:
    """Proportional allocation of ``limit`` items over strata (largest remainder, seeded ties)."""
    total = sum(sizes.values())
    if limit >= total:
        return dict(sizes)
    quotas = {s: limit * n / total for s, n in sizes.items()}
    alloc = {s: int(q) for s, q in quotas.items()}
    rng = random.Random(f"{seed}:allocate")
    tiebreak = {s: rng.random() for s in sorted(sizes)}
    left = limit - sum(alloc.values())
    for s in sorted(sizes, key=lambda s: (-(quotas[s] - alloc[s]), tiebreak[s]))[:left]:
        alloc[s] += 1
    return alloc


def prefix_of_permutation(n: int, k: int, key: str) -> list[int]:
    order = list(range(n))
    random.Random(key).shuffle(order)
    return sorted(order[:k])


def request_hash(lm_task_name: str, instances, target) -> str:
    """sha256 of a document's exact lm-eval requests and target: the gate pairs only equal hashes."""
    return sha256_json({"task": lm_task_name, "target": target,
                        "requests": [[i.request_type, list(i.arguments)] for i in instances]})


def build_sample(task_name: str, lm_task, doc_id: str, index: int, subject: str | None, doc: dict,
                 prompt: str) -> Sample:
    """A document's requests, built by the lm-eval task's own construct_requests, and their hash."""
    inst = lm_task.construct_requests(doc=doc, ctx=prompt, metadata=(lm_task.config.task, index, 1))
    inst = inst if isinstance(inst, list) else [inst]
    return Sample(task_name, doc_id, index, subject, doc, prompt, inst,
                  request_hash(lm_task.config.task, inst, lm_task.doc_to_target(doc)), lm_task.config.task)


def evaluate_chunk(lm, lm_tasks: dict[str, object], chunk: list[Sample]) -> dict[str, dict]:
    """A chunk of samples through lm-eval's own evaluator, `lm_eval.evaluator.evaluate(samples=...)`: it selects
    the documents by their ids, builds their requests (`Task.build_all_requests`), sends each request type to
    the LM in one call, applies the task's filters and scores with `Task.process_results`. Returns lm-eval's
    logged sample (`log_samples=True`) per document id, after checking that lm-eval sent exactly the requests
    whose hash the sample carries (the paired cache and gate rely on it).

    Only for tasks whose prompt does not depend on which other documents run (MMLU's `first_n` few-shot
    sampler): `build_all_requests` draws few-shot examples from one random stream in document order.
    lm-eval's aggregate results are not used (bootstrap off): the gate computes its own paired statistics.
    Its per-task request-building and tokenizing progress bars (no switch for them in `evaluate`) are kept
    off the terminal, where the runner draws its own; they are printed if the evaluation fails."""
    from lm_eval.evaluator import evaluate

    ids: dict[str, list[int]] = {}
    for s in chunk:
        ids.setdefault(s.lm_task, []).append(s.index)
    tasks = {name: lm_tasks[name] for name in ids}
    quiet_lm_eval()
    noise = io.StringIO()
    try:
        with contextlib.redirect_stderr(noise):
            res = evaluate(lm=lm, task_dict={"tasks": tasks, "groups": {}},
                           samples={k: sorted(v) for k, v in ids.items()}, log_samples=True, bootstrap_iters=0)
    except BaseException:
        sys.stderr.write(noise.getvalue())
        raise
    logged = {(name, x["doc_id"]): x for name, xs in res["samples"].items() for x in xs}
    out = {}
    for s in chunk:
        x = logged[(s.lm_task, s.index)]
        if [tuple(a) for a in x["arguments"]] != [tuple(i.arguments) for i in s.instances]:
            raise RuntimeError(f"{s.doc_id}: lm-eval's evaluator built other requests than the sample's "
                               "(hashed) ones; the paired records would not match their prompt hash")
        out[s.doc_id] = x
    return out
