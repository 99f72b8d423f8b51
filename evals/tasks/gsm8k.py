"""GSM8K: lm-eval's standard `gsm8k` task (gsm8k.yaml), greedy generation scored by lm-eval's filters and
process_results; two measures: `gsm8k` (per item: the extracted answer is right) and `gsm8k-gold` (per token of
the reference solution, teacher-forced after the prompt: the token was the greedy choice; clusters: documents;
the float64 truth run records it for the tolerance test).

Runs through the project's own loop, not lm-eval's evaluator (`lm_eval.evaluator.evaluate`), for two reasons:
- the prompt: `Task.build_all_requests` draws every document's few-shot examples from one random stream in
  document order (`ContextSampler.sample` on the task's single `Random`), so a document's prompt would depend
  on which documents run before it: a subset, a chunk or a resumed run would change prompts and their hashes.
  Here the sampler is reseeded per document (`ContextSampler.set_rnd(doc_seed(index))`, as the YAML says), and
  lm-eval's sampler cannot do that itself: `ConfigurableTask.fewshot_context` passes it no document when the
  few-shot split (train) is not the test split;
- teacher-forced reference tokens (`gsm8k-gold`) are no lm-eval request type (`LM.forced_scores` is ours).
Filtering and scoring are still lm-eval's: its filter ensembles (`lm_eval.filters.build_filter_ensemble`, from
the task's public config) and `Task.process_results`.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from dpep_parity.evals.tasks.base import (
    DEFAULT_SEED,
    EvalTask,
    Measure,
    PairingError,
    build_sample,
    config_from_yaml,
    configurable_task,
    doc_seed,
    prefix_of_permutation,
)

HUB = ("openai/gsm8k", "main")
_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")

# Reference-solution tokens teacher-forced per GSM8K document (gsm8k-gold): its whole lines within this many
# tokens (the first GOLD_TOKENS when its first line is longer). Its first line alone is 32-77 tokens (10th-90th
# percentile, fixture tokenizer): lengths differ, so DP ranks run out of decode work at different steps.
GOLD_TOKENS = 64


def gold_answer(answer: str) -> str:
    """The number after '#### ' in a GSM8K reference solution."""
    from dpep_parity.evals.data import DataError

    m = _ANSWER.search(answer)
    if not m:
        raise DataError(f"GSM8K answer without '#### <number>': {answer[-40:]!r}")
    return m.group(1).replace(",", "")


def config(max_gen_toks: int) -> dict:
    cfg = config_from_yaml("gsm8k")
    cfg["generation_kwargs"]["max_gen_toks"] = int(max_gen_toks)
    return cfg


# ------------------------------------------------------------------------------------ measures
def _outcomes(p, gate):
    yb = np.array([r["metrics"][gate.gsm8k_metric] for r in p.base])
    yc = np.array([r["metrics"][gate.gsm8k_metric] for r in p.cfg])
    return yb, yc, np.array([r["doc_id"] for r in p.base])


def _agreement(p):
    same = [rb["generation"] == rc["generation"] for rb, rc in zip(p.base, p.cfg, strict=True)]
    return float(np.mean(same)), "identical greedy generation"


def _gold_outcomes(p, gate):
    yb, yc, cl = [], [], []
    for rb, rc in zip(p.base, p.cfg, strict=True):
        if len(rb["gold_greedy"]) != len(rc["gold_greedy"]):
            raise PairingError(f"gsm8k-gold: {rb['doc_id']} scored {len(rb['gold_greedy'])} reference "
                               f"tokens on {p.base_name!r}, {len(rc['gold_greedy'])} on {p.cfg_name!r}")
        yb += rb["gold_greedy"]
        yc += rc["gold_greedy"]
        cl += [rb["doc_id"]] * len(rb["gold_greedy"])
    return np.array(yb, dtype=float), np.array(yc, dtype=float), np.array(cl)


def _gold_agreement(p):
    yb, yc = (np.array([x for r in rs for x in r["gold_greedy"]]) for rs in (p.base, p.cfg))
    return float(np.mean(yb == yc)), "same greedy verdict on each reference token"


def _gold_drift(p):
    lp = np.abs(np.array([x for r in p.base for x in r["gold_logprob"]])
                - np.array([x for r in p.cfg for x in r["gold_logprob"]]))
    return {"mean_abs_chosen": float(lp.mean()), "max_abs_chosen": float(lp.max()),
            "max_abs_any_choice": float(lp.max())}


# Margins (docs/evals.md, "Margins"): gsm8k 2 points, about 1.8 standard errors of its 1,319 items at 80 %;
# gsm8k-gold 1 point of tokens (tokens are many, so the difference is precise).
GSM8K = Measure("gsm8k", margin=2.0, unit="item", cluster=None, outcomes=_outcomes, agreement=_agreement)
GOLD = Measure("gsm8k-gold", margin=1.0, unit="token", cluster="document", outcomes=_gold_outcomes,
               agreement=_gold_agreement, drift=_gold_drift, tolerance=True,
               title="reference-solution tokens, teacher-forced")


@functools.lru_cache(maxsize=None)
def filters_of(task) -> list:
    """The filter pipelines lm-eval's evaluator applies to a task's generations before scoring, built from the
    task's public config with lm-eval's own `build_filter_ensemble`, as `ConfigurableTask.__init__` builds them
    (`Task.apply_filters` runs them only over the task's own instance list, which `build_all_requests` fills)."""
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


class GSM8KTask(EvalTask):
    name = "gsm8k"
    splits = ("test", "train")
    measures = (GSM8K, GOLD)
    truth_measure = "gsm8k-gold"
    order = 20

    # ----------------------------------------------------------------------------- data
    def check_row(self, row, where):
        from dpep_parity.evals.data import DataError

        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise DataError(f"{where}: field {key!r} must be a string (GSM8K rows need question, answer)")
        if not _ANSWER.search(row["answer"]):
            raise DataError(f"{where}: 'answer' does not end with '#### <number>'")

    def load_hub(self):
        import datasets

        ds = datasets.load_dataset(*HUB)
        return {"test": list(ds["test"]), "train": list(ds["train"])}

    # ----------------------------------------------------------------------------- lm-eval
    def lm_eval_task(self, taskset):
        return configurable_task(config(taskset.max_gen_toks),
                                 {sp: taskset.data.rows(self.name, sp) for sp in self.splits})

    # ----------------------------------------------------------------------------- documents
    def select(self, taskset, limit, seed=DEFAULT_SEED):
        n = len(taskset.data.rows(self.name, "test"))
        return list(range(n)) if limit is None else prefix_of_permutation(n, min(limit, n), f"{seed}:gsm8k")

    def context(self, taskset, index: int) -> tuple[dict, str]:
        """(doc, prompt) for test row `index`; few-shot examples seeded by the row index (module docstring)."""
        task = taskset.lm_task(self.name)
        doc = task.test_docs()[index]
        task.sampler.set_rnd(doc_seed(index))
        return doc, task.fewshot_context(doc, num_fewshot=task.config.num_fewshot)

    def build(self, taskset, selection):
        task = taskset.lm_task(self.name)
        return [build_sample(self.name, task, f"gsm8k/{index}", index, None, *self.context(taskset, index))
                for index in selection]

    # ----------------------------------------------------------------------------- running and scoring
    def gold_pair(self, taskset, s) -> tuple[str, str]:
        """(context, reference solution): the prompt and, after lm-eval's target delimiter, the dataset's worked
        answer, for teacher-forced scoring."""
        task = taskset.lm_task(self.name)
        return s.prompt, task.config.target_delimiter + task.doc_to_target(s.doc)

    def score(self, taskset, s, generation: str, gold=None) -> dict:
        """lm-eval's filters, then its process_results, on one generation."""
        task = taskset.lm_task(self.name)
        inst = dataclasses.replace(s.instances[0], resps=[generation], filtered_resps={})
        for f in filters_of(task):
            f.apply([inst])
        metrics, extracted = {}, {}
        for key, value in inst.filtered_resps.items():
            extracted[key] = value
            metrics[key] = float(task.process_results(s.doc, [value])["exact_match"])
        rec = {"task": self.name, "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, "subject": None,
               "gold": gold_answer(s.doc["answer"]), "generation": generation, "extracted": extracted,
               "metrics": metrics}
        return rec | (gold_fields(gold) if gold is not None else {})

    def run(self, lm, taskset, chunk):
        """The chunk's generations in one engine call, then (engines that can) its reference tokens forced."""
        gens = lm.generate_until([s.instances[0] for s in chunk], disable_tqdm=True)
        forced = getattr(lm, "forced_scores", None)
        golds = (forced([self.gold_pair(taskset, s) for s in chunk], GOLD_TOKENS) if callable(forced)
                 else [None] * len(chunk))
        return [self.score(taskset, s, g, gold) for s, g, gold in zip(chunk, gens, golds, strict=True)]

    def run_truth(self, lm, taskset, chunk):
        """The truth run: only the teacher-forced reference tokens; nothing generated."""
        golds = lm.forced_scores([self.gold_pair(taskset, s) for s in chunk], GOLD_TOKENS)
        return [{"task": GOLD.name, "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, **gold_fields(g)}
                for s, g in zip(chunk, golds, strict=True)]

    # ----------------------------------------------------------------------------- gate
    def measures_of(self, p):
        """gsm8k-gold only when both runs recorded reference tokens (in-process engines)."""
        gold = all("gold_greedy" in r for r in p.base + p.cfg)
        return ["gsm8k", "gsm8k-gold"] if gold and p.base else ["gsm8k"]

    def tests(self, in_process, truth):
        """gsm8k's difference test; gsm8k-gold's (in-process engines); the tolerance test's pooled and tail
        tests (with a truth run)."""
        return 1 + bool(in_process) + 2 * bool(truth)


TASK = GSM8KTask()
