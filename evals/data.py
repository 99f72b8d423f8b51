"""Evaluation data of the registered tasks (evals/tasks/): from the Hugging Face hub or from a local directory.

Local layout (as in ``../shared/data``), one folder per task with one file per split the task names::

    DIR/mmlu/test.jsonl   DIR/mmlu/dev.jsonl      (subject, question, choices[4], answer 0-3)
    DIR/gsm8k/test.jsonl  DIR/gsm8k/train.jsonl   (question, answer ending in "#### <number>")

Both sources yield the same in-memory rows, checked by the same validator (the task's `check_row` and
`check_splits`), so a malformed local directory (or a changed hub dataset) is a clear :class:`DataError`
before any model work starts.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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
def _tasks(names: tuple[str, ...] | None) -> list:
    from dpep_parity.evals import tasks

    return [tasks.get(n) for n in (tasks.names() if names is None else names)]


def validate_rows(task: str, split: str, rows: list, origin: str) -> None:
    """Every row through the task's validator (evals/tasks/<task>.py, `check_row`)."""
    from dpep_parity.evals import tasks

    if not rows:
        raise DataError(f"{origin}: no rows in {task}/{split}")
    check = tasks.get(task).check_row
    for i, row in enumerate(rows):
        check(row, f"{origin}:{i + 1}")


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


def check_data_dir(data_dir: Path | str, tasks: tuple[str, ...] | None = None) -> Path:
    """Cheap structural check (directory and files present) used before anything starts. `tasks`: task names
    (default: every registered task)."""
    d = Path(data_dir)
    todo = _tasks(tasks)
    if not d.is_dir():
        layout = ", ".join(f"{t.name}/*.jsonl" for t in todo)
        raise DataError(f"data dir {d} does not exist or is not a directory "
                        f"(expected the layout of ../shared/data: {layout})")
    for task in todo:
        for split in task.splits:
            f = d / task.name / f"{split}.jsonl"
            if not f.is_file():
                raise DataError(f"data dir {d}: missing {task.name}/{split}.jsonl")
    return d


def load_local(data_dir: Path | str, tasks: tuple[str, ...] | None = None) -> EvalData:
    d = check_data_dir(data_dir, tasks)
    data = EvalData(source=f"local:{d.resolve()}")
    for task in _tasks(tasks):
        data.splits[task.name] = {}
        for split in task.splits:
            path = d / task.name / f"{split}.jsonl"
            rows = read_jsonl(path)
            validate_rows(task.name, split, rows, str(path))
            data.splits[task.name][split] = rows
        task.check_splits(data.splits[task.name], str(d / task.name))
    return data


def load_hub(tasks: tuple[str, ...] | None = None) -> EvalData:
    """The real hub path: each task's `load_hub` (cais/mmlu, one config per subject as lm-eval loads it;
    openai/gsm8k)."""
    try:
        return _load_hub(tasks)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"could not load the evaluation data from the Hugging Face hub "
                        f"({type(e).__name__}: {e}); pass --data-dir DIR to use a local copy") from e


def _load_hub(tasks: tuple[str, ...] | None) -> EvalData:
    data = EvalData(source="hub")
    todo = _tasks(tasks)
    for task in todo:
        data.splits[task.name] = task.load_hub()
    for task in todo:
        for split, rows in data.splits[task.name].items():
            validate_rows(task.name, split, rows, f"hub:{task.name}/{split}")
        task.check_splits(data.splits[task.name], f"hub:{task.name}")
    return data


def load_data(data_dir: Path | str | None, tasks: tuple[str, ...] | None = None) -> EvalData:
    return load_hub(tasks) if data_dir is None else load_local(data_dir, tasks)
