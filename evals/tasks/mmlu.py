"""MMLU: lm-eval's standard `mmlu` prompt (mmlu.yaml), one lm-eval task per subject, all 57; one measure, `mmlu`
(per item: the answer is right; clusters: subjects; plus the answer-symmetry test). Runs through lm-eval's own
evaluator (base.evaluate_chunk)."""
from __future__ import annotations

from functools import cache

import numpy as np
import yaml

from dpep_parity.evals.tasks.base import (
    DEFAULT_SEED,
    HERE,
    EvalTask,
    Measure,
    allocate,
    build_sample,
    config_from_yaml,
    configurable_task,
    evaluate_chunk,
    prefix_of_permutation,
)

HUB = "cais/mmlu"


@cache
def _subjects() -> dict[str, str]:
    return yaml.safe_load((HERE / "mmlu_subjects.yaml").read_text())


SUBJECTS: tuple[str, ...] = tuple(_subjects())
CATEGORY: dict[str, str] = dict(_subjects())


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def config(subject: str) -> dict:
    return config_from_yaml("mmlu", task=f"dpep_mmlu_{subject}", dataset_name=subject,
                            description=description(subject))


def _outcomes(p, gate):
    yb = np.array([r["metrics"]["acc"] for r in p.base])
    yc = np.array([r["metrics"]["acc"] for r in p.cfg])
    return yb, yc, np.array([r["subject"] for r in p.base])


def _agreement(p):
    same = np.array([rb["pred"] for rb in p.base]) == np.array([rc["pred"] for rc in p.cfg])
    return float(np.mean(same)), "same answer letter"


def _drift(p):
    pairs = list(zip(p.base, p.cfg, strict=True))
    chosen = np.array([abs(rc["lls"][rb["pred"]] - rb["lls"][rb["pred"]]) for rb, rc in pairs])
    every = np.array([max(abs(x - y) for x, y in zip(rb["lls"], rc["lls"], strict=True)) for rb, rc in pairs])
    return {"mean_abs_chosen": float(chosen.mean()), "max_abs_chosen": float(chosen.max()),
            "max_abs_any_choice": float(every.max())}


# Margin: 1 point, about 2.5 standard errors of the full benchmark (14,042 items) at 70 % accuracy, below the
# spread of published reruns of one model (docs/evals.md, "Margins").
MMLU = Measure("mmlu", margin=1.0, unit="item", cluster="subject", outcomes=_outcomes, agreement=_agreement,
               drift=_drift, answers=lambda p: ([r["pred"] for r in p.base], [r["pred"] for r in p.cfg]))


class MMLUTask(EvalTask):
    name = "mmlu"
    splits = ("test", "dev")
    measures = (MMLU,)
    order = 10

    # ----------------------------------------------------------------------------- data
    def check_row(self, row, where):
        from dpep_parity.evals.data import DataError

        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key, typ in (("subject", str), ("question", str), ("choices", list), ("answer", int)):
            if key not in row:
                raise DataError(f"{where}: missing field {key!r} (MMLU rows need subject, question, "
                                f"choices, answer)")
            if not isinstance(row[key], typ) or isinstance(row[key], bool):
                raise DataError(f"{where}: field {key!r} must be {typ.__name__}, got {type(row[key]).__name__}")
        if len(row["choices"]) != 4 or not all(isinstance(c, str) for c in row["choices"]):
            raise DataError(f"{where}: 'choices' must be a list of 4 strings")
        if not 0 <= row["answer"] <= 3:
            raise DataError(f"{where}: 'answer' must be 0..3, got {row['answer']}")
        if not row["subject"]:
            raise DataError(f"{where}: empty 'subject'")

    def check_splits(self, splits, origin):
        from collections import Counter

        from dpep_parity.evals.data import DataError

        test, dev = splits["test"], splits["dev"]
        missing = sorted(set(SUBJECTS) - {r["subject"] for r in test})
        if missing:
            raise DataError(f"{origin}: MMLU test lacks {len(missing)} of the 57 subjects, e.g. {missing[:3]}")
        unknown = sorted({r["subject"] for r in test} - set(SUBJECTS))
        if unknown:
            raise DataError(f"{origin}: MMLU test has unknown subjects {unknown[:3]}")
        per_subject = Counter(r["subject"] for r in dev)
        short = sorted(s for s in SUBJECTS if per_subject[s] < 5)
        if short:
            raise DataError(f"{origin}: MMLU dev needs 5 few-shot rows per subject; too few for {short[:3]}")

    def load_hub(self):
        """cais/mmlu, one config per subject, as lm-eval loads it."""
        import datasets

        test, dev = [], []
        for subject in SUBJECTS:
            ds = datasets.load_dataset(HUB, subject)
            test += [dict(r, subject=subject) for r in ds["test"]]
            dev += [dict(r, subject=subject) for r in ds["dev"]]
        return {"test": test, "dev": dev}

    def rows(self, taskset, subject: str, split: str) -> list[dict]:
        def by_subject():
            by: dict[str, dict[str, list[dict]]] = {}
            for sp in self.splits:
                for row in taskset.data.rows(self.name, sp):
                    by.setdefault(row["subject"], {}).setdefault(sp, []).append(row)
            return by
        return taskset.memo(("mmlu-rows",), by_subject)[subject][split]

    # ----------------------------------------------------------------------------- lm-eval
    def lm_eval_task(self, taskset, subject):
        return configurable_task(config(subject), {sp: self.rows(taskset, subject, sp) for sp in self.splits})

    # ----------------------------------------------------------------------------- documents
    def select(self, taskset, limit, seed=DEFAULT_SEED):
        """Stratified by subject: proportional allocation, largest remainder, a seeded permutation within each."""
        sizes = {s: len(self.rows(taskset, s, "test")) for s in SUBJECTS}
        alloc = sizes if limit is None else allocate(sizes, limit, seed)
        return [(s, i) for s in SUBJECTS for i in prefix_of_permutation(sizes[s], alloc[s], f"{seed}:{s}")]

    def context(self, taskset, subject: str, index: int) -> tuple[dict, str]:
        task = taskset.lm_task(self.name, subject)
        doc = task.test_docs()[index]
        return doc, task.fewshot_context(doc, num_fewshot=task.config.num_fewshot)

    def build(self, taskset, selection):
        out = []
        for subject, index in selection:
            doc, prompt = self.context(taskset, subject, index)
            out.append(build_sample(self.name, taskset.lm_task(self.name, subject), f"mmlu/{subject}/{index}",
                                    index, subject, doc, prompt))
        return out

    # ----------------------------------------------------------------------------- running and scoring
    def run(self, lm, taskset, chunk):
        """lm-eval's evaluator does the whole job here: the `first_n` few-shot sampler makes a document's
        prompt independent of which others run."""
        tasks = {s.lm_task: taskset.lm_task(self.name, s.subject) for s in chunk}
        logged = evaluate_chunk(lm, tasks, chunk)
        return [self.record(s, logged[s.doc_id]) for s in chunk]

    def record(self, s, logged: dict) -> dict:
        """The paired record of one document from lm-eval's logged sample (filter "none": the raw
        (log-likelihood, is-greedy) pair per answer letter; "acc" from the task's process_results)."""
        resps = logged["filtered_resps"]
        lls = [float(ll) for ll, _ in resps]
        return {"task": self.name, "doc_id": s.doc_id, "prompt_hash": s.prompt_hash, "subject": s.subject,
                "gold": int(s.doc["answer"]), "lls": lls, "greedy": [bool(g) for _, g in resps],
                "pred": max(range(len(lls)), key=lambda i: (lls[i], -i)),
                "metrics": {"acc": float(logged["acc"])}}


TASK = MMLUTask()
