"""Which documents run (a seeded, stratified subset), their lm-eval requests, and their scoring.

Every configuration sees exactly the same documents and prompts: the subset depends only on the
data, the limit and the seed; each sample carries a sha256 of its exact requests and target.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass, field

from dpep_parity.evals.cache import sha256_json
from dpep_parity.evals.data import gsm8k_gold
from dpep_parity.evals.tasks import MMLU_SUBJECTS, TaskSet

DEFAULT_SEED = 1234


@dataclass
class Sample:
    task: str                 # "mmlu" | "gsm8k"
    doc_id: str               # "mmlu/<subject>/<index>" | "gsm8k/<index>" (index: lm-eval's doc_id)
    index: int
    subject: str | None
    doc: dict
    prompt: str
    instances: list = field(repr=False)
    prompt_hash: str = ""


# ------------------------------------------------------------------------------------ subsets
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


def _prefix_of_permutation(n: int, k: int, key: str) -> list[int]:
    order = list(range(n))
    random.Random(key).shuffle(order)
    return sorted(order[:k])


def select_mmlu(taskset: TaskSet, limit: int | None, seed: int = DEFAULT_SEED) -> list[tuple[str, int]]:
    sizes = {s: len(taskset.mmlu_rows(s, "test")) for s in MMLU_SUBJECTS}
    alloc = sizes if limit is None else allocate(sizes, limit, seed)
    return [(s, i) for s in MMLU_SUBJECTS for i in _prefix_of_permutation(sizes[s], alloc[s], f"{seed}:{s}")]


def select_gsm8k(taskset: TaskSet, limit: int | None, seed: int = DEFAULT_SEED) -> list[int]:
    n = len(taskset.data.rows("gsm8k", "test"))
    return list(range(n)) if limit is None else _prefix_of_permutation(n, min(limit, n), f"{seed}:gsm8k")


# ------------------------------------------------------------------------------------ requests
def _hash(task_name: str, instances, target) -> str:
    return sha256_json({"task": task_name, "target": target,
                        "requests": [[i.request_type, list(i.arguments)] for i in instances]})


def build_mmlu(taskset: TaskSet, selection: list[tuple[str, int]]) -> list[Sample]:
    out = []
    for subject, index in selection:
        task = taskset.mmlu_task(subject)
        doc, prompt = taskset.mmlu_context(subject, index)
        inst = task.construct_requests(doc=doc, ctx=prompt, metadata=(task.config.task, index, 1))
        inst = inst if isinstance(inst, list) else [inst]
        s = Sample("mmlu", f"mmlu/{subject}/{index}", index, subject, doc, prompt, inst)
        s.prompt_hash = _hash(task.config.task, inst, task.doc_to_target(doc))
        out.append(s)
    return out


def build_gsm8k(taskset: TaskSet, selection: list[int]) -> list[Sample]:
    task = taskset.gsm8k_task()
    out = []
    for index in selection:
        doc, prompt = taskset.gsm8k_context(index)
        inst = task.construct_requests(doc=doc, ctx=prompt, metadata=(task.config.task, index, 1))
        inst = inst if isinstance(inst, list) else [inst]
        s = Sample("gsm8k", f"gsm8k/{index}", index, None, doc, prompt, inst)
        s.prompt_hash = _hash(task.config.task, inst, task.doc_to_target(doc))
        out.append(s)
    return out


# ------------------------------------------------------------------------------------ scoring
def score_mmlu(taskset: TaskSet, s: Sample, resps: list[tuple[float, bool]]) -> dict:
    task = taskset.mmlu_task(s.subject)
    metrics = task.process_results(s.doc, resps)
    lls = [float(ll) for ll, _ in resps]
    return {"task": "mmlu", "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, "subject": s.subject,
            "gold": int(s.doc["answer"]), "lls": lls, "greedy": [bool(g) for _, g in resps],
            "pred": max(range(len(lls)), key=lambda i: (lls[i], -i)),
            "metrics": {"acc": float(metrics["acc"])}}


# Reference-solution tokens teacher-forced per GSM8K document (gsm8k-gold): its whole lines within this many
# tokens (the first GOLD_TOKENS when its first line is longer). Its first line alone is 32-77 tokens (10th-90th
# percentile, fixture tokenizer): lengths differ, so DP ranks run out of decode work at different steps.
GOLD_TOKENS = 64


def gold_pair(taskset: TaskSet, s: Sample) -> tuple[str, str]:
    """(context, reference solution) of a GSM8K document: the prompt and, after lm-eval's target delimiter,
    the dataset's worked answer, for teacher-forced scoring."""
    task = taskset.gsm8k_task()
    return s.prompt, task.config.target_delimiter + task.doc_to_target(s.doc)


def score_gsm8k(taskset: TaskSet, s: Sample, generation: str, gold=None) -> dict:
    task = taskset.gsm8k_task()
    inst = dataclasses.replace(s.instances[0], resps=[generation], filtered_resps={})
    for f in filters_of(task):
        f.apply([inst])
    metrics, extracted = {}, {}
    for key, value in inst.filtered_resps.items():
        extracted[key] = value
        metrics[key] = float(task.process_results(s.doc, [value])["exact_match"])
    rec = {"task": "gsm8k", "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, "subject": None,
           "gold": gsm8k_gold(s.doc["answer"]), "generation": generation, "extracted": extracted,
           "metrics": metrics}
    if gold is not None:
        rec |= gold_fields(gold)
    return rec


@functools.lru_cache(maxsize=None)
def filters_of(task) -> list:
    """The filter pipelines lm-eval's evaluator applies to a task's generations before scoring, built from the
    task's public config with lm-eval's own `build_filter_ensemble` as the task builds them (it keeps its
    copy in a private attribute)."""
    from lm_eval.filters import build_filter_ensemble
    if task.config.filter_list is None:
        return [build_filter_ensemble("none", [["take_first", None]])]
    return [build_filter_ensemble(fc["name"], [[fn["function"], {k: v for k, v in fn.items() if k != "function"}]
                                               for fn in fc["filter"]])
            for fc in task.config.filter_list]


def gold_fields(gold) -> dict:
    """A teacher-forced reference solution, per token: greedy choice, and log-probability (unrounded: the
    tolerance test needs its noise)."""
    return {"gold_greedy": [bool(g) for _, g in gold], "gold_logprob": [float(lp) for lp, _ in gold]}


def score_gold(s: Sample, gold) -> dict:
    """The truth run's record of a GSM8K document: only its teacher-forced reference tokens."""
    return {"task": "gsm8k-gold", "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, **gold_fields(gold)}


def run_chunk(lm, taskset: TaskSet, task: str, chunk: list[Sample]) -> list[dict]:
    """One engine call for a chunk of samples; returns their scored records. Task "gsm8k-gold" (the truth
    run) teacher-forces the GSM8K samples' reference solutions and generates nothing."""
    if task == "gsm8k-gold":
        golds = lm.forced_scores([gold_pair(taskset, s) for s in chunk], GOLD_TOKENS)
        return [score_gold(s, g) for s, g in zip(chunk, golds, strict=True)]
    if task == "mmlu":
        flat = [inst for s in chunk for inst in s.instances]
        results = lm.loglikelihood(flat, disable_tqdm=True)
        out, k = [], 0
        for s in chunk:
            n = len(s.instances)
            out.append(score_mmlu(taskset, s, results[k:k + n]))
            k += n
        return out
    gens = lm.generate_until([s.instances[0] for s in chunk], disable_tqdm=True)
    forced = getattr(lm, "forced_scores", None)
    golds = forced([gold_pair(taskset, s) for s in chunk], GOLD_TOKENS) if callable(forced) else [None] * len(chunk)
    return [score_gsm8k(taskset, s, g, gold) for s, g, gold in zip(chunk, gens, golds)]
