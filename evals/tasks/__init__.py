"""lm-eval task definitions (the YAML files beside this module) bound to validated data.

``TaskSet(data, max_gen_toks=...)`` builds lm-eval ``ConfigurableTask`` objects: one per MMLU subject
(``dpep_mmlu_<subject>``) and ``dpep_gsm8k``. Their prompts, request construction, filters and
``process_results`` are lm-eval's own; only the dataset comes from :mod:`evals.data`.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from functools import cache
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


@cache
def _subjects() -> dict[str, str]:
    return yaml.safe_load((HERE / "mmlu_subjects.yaml").read_text())


MMLU_SUBJECTS: tuple[str, ...] = tuple(_subjects())
MMLU_CATEGORY: dict[str, str] = dict(_subjects())


@cache
def task_yaml(name: str) -> dict:
    return yaml.safe_load((HERE / f"{name}.yaml").read_text())


def mmlu_description(subject: str) -> str:
    words = subject.replace("_", " ")
    return f"The following are multiple choice questions (with answers) about {words}.\n\n"


def mmlu_config(subject: str) -> dict:
    cfg = copy.deepcopy(task_yaml("mmlu"))
    cfg.update(task=f"dpep_mmlu_{subject}", dataset_name=subject, description=mmlu_description(subject))
    return cfg


def gsm8k_config(max_gen_toks: int) -> dict:
    cfg = copy.deepcopy(task_yaml("gsm8k"))
    cfg["generation_kwargs"]["max_gen_toks"] = int(max_gen_toks)
    return cfg


def doc_seed(doc_index: int, seed: int = FEWSHOT_SEED) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_index}".encode()).digest()[:8], "big")


def quiet_lm_eval() -> None:
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


class TaskSet:
    """lm-eval task objects over one :class:`evals.data.EvalData`, built lazily and cached."""

    def __init__(self, data, max_gen_toks: int = 256) -> None:
        self.data = data
        self.max_gen_toks = int(max_gen_toks)
        self._mmlu: dict[str, object] = {}
        self._gsm8k = None
        self._mmlu_by_subject: dict[str, list[dict]] | None = None

    # --------------------------------------------------------------------------------- datasets
    def mmlu_rows(self, subject: str, split: str) -> list[dict]:
        if self._mmlu_by_subject is None:
            by: dict[str, dict[str, list[dict]]] = {}
            for sp in ("test", "dev"):
                for row in self.data.rows("mmlu", sp):
                    by.setdefault(row["subject"], {}).setdefault(sp, []).append(row)
            self._mmlu_by_subject = by
        return self._mmlu_by_subject[subject][split]

    @staticmethod
    def _dataset_dict(splits: dict[str, list[dict]]):
        import datasets

        return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})

    # --------------------------------------------------------------------------------- tasks
    def mmlu_task(self, subject: str):
        if subject not in self._mmlu:
            from lm_eval.api.task import ConfigurableTask

            quiet_lm_eval()
            splits = {sp: self.mmlu_rows(subject, sp) for sp in ("test", "dev")}
            cfg = mmlu_config(subject)
            cfg["custom_dataset"] = lambda **_: self._dataset_dict(splits)
            self._mmlu[subject] = ConfigurableTask(config=cfg)
        return self._mmlu[subject]

    def gsm8k_task(self):
        if self._gsm8k is None:
            from lm_eval.api.task import ConfigurableTask

            quiet_lm_eval()
            splits = {sp: self.data.rows("gsm8k", sp) for sp in ("test", "train")}
            cfg = gsm8k_config(self.max_gen_toks)
            cfg["custom_dataset"] = lambda **_: self._dataset_dict(splits)
            self._gsm8k = ConfigurableTask(config=cfg)
        return self._gsm8k

    def gsm8k_context(self, index: int) -> tuple[dict, str]:
        """(doc, prompt) for GSM8K test row ``index``; few-shot examples seeded by the row index."""
        task = self.gsm8k_task()
        doc = task.test_docs()[index]
        task.sampler.set_rnd(doc_seed(index))
        return doc, task.fewshot_context(doc, num_fewshot=task.config.num_fewshot)

    def mmlu_context(self, subject: str, index: int) -> tuple[dict, str]:
        task = self.mmlu_task(subject)
        doc = task.test_docs()[index]
        return doc, task.fewshot_context(doc, num_fewshot=task.config.num_fewshot)
