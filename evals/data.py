"""Evaluation data: MMLU and GSM8K from the Hugging Face hub or from a local directory.

Local layout (as in ``../shared/data``)::

    DIR/mmlu/test.jsonl   DIR/mmlu/dev.jsonl      (subject, question, choices[4], answer 0-3)
    DIR/gsm8k/test.jsonl  DIR/gsm8k/train.jsonl   (question, answer ending in "#### <number>")

Both sources yield the same in-memory rows, checked by the same validator, so a malformed local
directory (or a changed hub dataset) is a clear :class:`DataError` before any model work starts.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HUB_MMLU = "cais/mmlu"
HUB_GSM8K = ("openai/gsm8k", "main")
TASKS = ("mmlu", "gsm8k")
FILES = {"mmlu": ("test", "dev"), "gsm8k": ("test", "train")}
_GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")


class DataError(ValueError):
    """The evaluation data is missing or malformed."""


def default_data_dir() -> Path:
    """Where tests and CI find the offline data: $DPEP_DATA_DIR, else <repo>/../shared/data."""
    env = os.environ.get("DPEP_DATA_DIR")
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data"


@dataclass
class EvalData:
    """Validated rows per task and split; ``source`` says where they came from."""

    source: str
    splits: dict[str, dict[str, list[dict]]] = field(default_factory=dict)

    def rows(self, task: str, split: str) -> list[dict]:
        return self.splits[task][split]


# ---------------------------------------------------------------------------------------- validation
def _check_mmlu_row(row: object, where: str) -> None:
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


def _check_gsm8k_row(row: object, where: str) -> None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise DataError(f"{where}: field {key!r} must be a string (GSM8K rows need question, answer)")
    if not _GSM8K_ANSWER.search(row["answer"]):
        raise DataError(f"{where}: 'answer' does not end with '#### <number>'")


_CHECKERS = {"mmlu": _check_mmlu_row, "gsm8k": _check_gsm8k_row}


def validate_rows(task: str, split: str, rows: list, origin: str) -> None:
    if not rows:
        raise DataError(f"{origin}: no rows in {task}/{split}")
    check = _CHECKERS[task]
    for i, row in enumerate(rows):
        check(row, f"{origin}:{i + 1}")


def validate_mmlu_splits(test: list[dict], dev: list[dict], origin: str) -> None:
    from dpep_parity.evals.tasks import MMLU_SUBJECTS

    missing = sorted(set(MMLU_SUBJECTS) - {r["subject"] for r in test})
    if missing:
        raise DataError(f"{origin}: MMLU test lacks {len(missing)} of the 57 subjects, e.g. {missing[:3]}")
    unknown = sorted({r["subject"] for r in test} - set(MMLU_SUBJECTS))
    if unknown:
        raise DataError(f"{origin}: MMLU test has unknown subjects {unknown[:3]}")
    per_subject = Counter(r["subject"] for r in dev)
    short = sorted(s for s in MMLU_SUBJECTS if per_subject[s] < 5)
    if short:
        raise DataError(f"{origin}: MMLU dev needs 5 few-shot rows per subject; too few for {short[:3]}")


# ---------------------------------------------------------------------------------------- loading
def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return rows


def check_data_dir(data_dir: Path | str, tasks: tuple[str, ...] = TASKS) -> Path:
    """Cheap structural check (directory and files present) used before anything starts."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data dir {d} does not exist or is not a directory "
                        f"(expected the layout of ../shared/data: mmlu/*.jsonl, gsm8k/*.jsonl)")
    for task in tasks:
        for split in FILES[task]:
            f = d / task / f"{split}.jsonl"
            if not f.is_file():
                raise DataError(f"data dir {d}: missing {task}/{split}.jsonl")
    return d


def load_local(data_dir: Path | str, tasks: tuple[str, ...] = TASKS) -> EvalData:
    d = check_data_dir(data_dir, tasks)
    data = EvalData(source=f"local:{d.resolve()}")
    for task in tasks:
        data.splits[task] = {}
        for split in FILES[task]:
            path = d / task / f"{split}.jsonl"
            rows = read_jsonl(path)
            validate_rows(task, split, rows, str(path))
            data.splits[task][split] = rows
    if "mmlu" in tasks:
        validate_mmlu_splits(data.rows("mmlu", "test"), data.rows("mmlu", "dev"), str(d / "mmlu"))
    return data


def load_hub(tasks: tuple[str, ...] = TASKS) -> EvalData:
    """The real hub path: cais/mmlu (one config per subject, as lm-eval loads it) and openai/gsm8k."""
    try:
        return _load_hub(tasks)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"could not load the evaluation data from the Hugging Face hub "
                        f"({type(e).__name__}: {e}); pass --data-dir DIR to use a local copy") from e


def _load_hub(tasks: tuple[str, ...]) -> EvalData:
    import datasets

    from dpep_parity.evals.tasks import MMLU_SUBJECTS

    data = EvalData(source="hub")
    if "mmlu" in tasks:
        test, dev = [], []
        for subject in MMLU_SUBJECTS:
            ds = datasets.load_dataset(HUB_MMLU, subject)
            test += [dict(r, subject=subject) for r in ds["test"]]
            dev += [dict(r, subject=subject) for r in ds["dev"]]
        data.splits["mmlu"] = {"test": test, "dev": dev}
    if "gsm8k" in tasks:
        ds = datasets.load_dataset(*HUB_GSM8K)
        data.splits["gsm8k"] = {"test": list(ds["test"]), "train": list(ds["train"])}
    for task in tasks:
        for split, rows in data.splits[task].items():
            validate_rows(task, split, rows, f"hub:{task}/{split}")
    if "mmlu" in tasks:
        validate_mmlu_splits(data.rows("mmlu", "test"), data.rows("mmlu", "dev"), "hub:cais/mmlu")
    return data


def load_data(data_dir: Path | str | None, tasks: tuple[str, ...] = TASKS) -> EvalData:
    return load_hub(tasks) if data_dir is None else load_local(data_dir, tasks)


def gsm8k_gold(answer: str) -> str:
    m = _GSM8K_ANSWER.search(answer)
    if not m:
        raise DataError(f"GSM8K answer without '#### <number>': {answer[-40:]!r}")
    return m.group(1).replace(",", "")
