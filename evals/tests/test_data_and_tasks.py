"""Data directory errors, the task definitions' prompts, and the paired subset."""
from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from dpep_parity.evals.data import DataError, check_data_dir, load_local
from dpep_parity.evals.samples import allocate
from dpep_parity.evals.tasks import TaskSet
from dpep_parity.evals.tasks.base import dataset_dict
from dpep_parity.evals.tasks.gsm8k import TASK as GSM8K
from dpep_parity.evals.tasks.gsm8k import gold_answer
from dpep_parity.evals.tasks.mmlu import SUBJECTS as MMLU_SUBJECTS
from dpep_parity.evals.tasks.mmlu import TASK as MMLU


def build_mmlu(taskset, selection):
    return MMLU.build(taskset, selection)


def build_gsm8k(taskset, selection):
    return GSM8K.build(taskset, selection)


def select_mmlu(taskset, limit, seed):
    return MMLU.select(taskset, limit, seed)


def select_gsm8k(taskset, limit, seed):
    return GSM8K.select(taskset, limit, seed)

MMLU_ROW = {"subject": "anatomy", "question": "q?", "choices": ["a", "b", "c", "d"], "answer": 1}
GSM_ROW = {"question": "q?", "answer": "so 2\n#### 2"}


def _write(d, rel, rows):
    p = d / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _tiny_data(d):
    rows = [dict(MMLU_ROW, subject=s) for s in MMLU_SUBJECTS]
    _write(d, "mmlu/test.jsonl", rows)
    _write(d, "mmlu/dev.jsonl", rows * 5)
    _write(d, "gsm8k/test.jsonl", [GSM_ROW])
    _write(d, "gsm8k/train.jsonl", [GSM_ROW] * 6)
    return d


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        check_data_dir(tmp_path / "nope")
    d = _tiny_data(tmp_path / "d")
    (d / "gsm8k" / "train.jsonl").unlink()
    with pytest.raises(DataError, match=r"missing gsm8k/train\.jsonl"):
        check_data_dir(d)
    assert check_data_dir(d, ("mmlu",)) == d


@pytest.mark.parametrize("rel,row,message", [
    ("mmlu/test.jsonl", "{not json", r"test\.jsonl:58: not valid JSON"),
    ("mmlu/test.jsonl", {"subject": "anatomy", "question": "q", "choices": ["a"], "answer": 0},
     "choices' must be a list of 4"),
    ("mmlu/test.jsonl", {"subject": "anatomy", "question": "q", "choices": list("abcd")},
     "missing field 'answer'"),
    ("mmlu/test.jsonl", dict(MMLU_ROW, answer=7), "'answer' must be 0..3"),
    ("gsm8k/test.jsonl", {"question": "q", "answer": "no marker"}, r"does not end with '#### <number>'"),
])
def test_malformed_rows_are_named(tmp_path, rel, row, message):
    d = _tiny_data(tmp_path)
    with open(d / rel, "a") as fh:
        fh.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(DataError, match=message):
        load_local(d)


def test_missing_subject_and_short_dev(tmp_path):
    d = _tiny_data(tmp_path)
    _write(d, "mmlu/test.jsonl", [dict(MMLU_ROW, subject=s) for s in MMLU_SUBJECTS[1:]])
    with pytest.raises(DataError, match="lacks 1 of the 57 subjects"):
        load_local(d)
    d = _tiny_data(tmp_path / "b")
    _write(d, "mmlu/dev.jsonl", [dict(MMLU_ROW, subject=s) for s in MMLU_SUBJECTS])
    with pytest.raises(DataError, match="5 few-shot rows per subject"):
        load_local(d)


def test_gsm8k_first_item_is_janets_ducks(taskset):
    (s,) = build_gsm8k(taskset, [0])
    assert s.doc["question"].startswith("Janet’s ducks lay 16 eggs per day")
    assert gold_answer(s.doc["answer"]) == "18"
    assert s.prompt.endswith("Question: " + s.doc["question"] + "\nAnswer:")
    shots = s.prompt.split("\n\n")
    assert len(shots) == 6 and all(re.search(r"#### -?[\d,.]+$", x) for x in shots[:5])
    args = s.instances[0].arguments
    assert args[1]["until"] == ["Question:", "</s>", "<|im_end|>"] and args[1]["max_gen_toks"] == 8
    # lm-eval's strict and flexible filters read the gold answer text as 18
    rec = GSM8K.score(taskset, s, s.doc["answer"].split("\n")[-1])
    assert rec["extracted"] == {"strict-match": "18", "flexible-extract": "18"}
    assert rec["metrics"] == {"strict-match": 1.0, "flexible-extract": 1.0}
    assert GSM8K.score(taskset, s, " she makes 9 * 2 = 18 dollars")["metrics"] == {
        "strict-match": 0.0, "flexible-extract": 1.0}


def _lm_eval_builtin(name: str) -> dict:
    from pathlib import Path

    import lm_eval

    root = Path(lm_eval.__file__).parent / "tasks"
    if name == "gsm8k":
        return yaml.safe_load((root / "gsm8k" / "gsm8k.yaml").read_text())
    d = root / "mmlu" / "default"
    cfg = yaml.safe_load((d / "_default_template_yaml").read_text())
    cfg.update({k: v for k, v in yaml.safe_load((d / f"mmlu_{name}.yaml").read_text()).items()
                if k not in ("include", "tag")})
    return cfg


def test_prompts_equal_lm_eval_builtin_tasks(taskset):
    """Our YAML gives exactly the prompts and requests of lm-eval's own mmlu and gsm8k tasks."""
    from lm_eval.api.task import ConfigurableTask

    for subject, index in [("abstract_algebra", 0), ("high_school_psychology", 17), ("virology", 3)]:
        cfg = _lm_eval_builtin(subject)
        splits = {sp: MMLU.rows(taskset, subject, sp) for sp in ("test", "dev")}
        cfg["custom_dataset"] = lambda splits=splits, **_: dataset_dict(splits)
        ref = ConfigurableTask(config=cfg)
        doc = ref.test_docs()[index]
        ctx = ref.fewshot_context(doc, num_fewshot=5)
        (s,) = build_mmlu(taskset, [(subject, index)])
        assert s.prompt == ctx
        assert [i.arguments for i in s.instances] == [(ctx, f" {x}") for x in "ABCD"]
        assert s.prompt.startswith(f"The following are multiple choice questions (with answers) about "
                                   f"{subject.replace('_', ' ')}.\n\n")
        assert s.prompt.count("\nAnswer:") == 6
    cfg = copy.deepcopy(_lm_eval_builtin("gsm8k"))
    splits = {sp: taskset.data.rows("gsm8k", sp) for sp in ("test", "train")}
    cfg["custom_dataset"] = lambda **_: dataset_dict(splits)
    ref = ConfigurableTask(config=cfg)
    from dpep_parity.evals.tasks.base import doc_seed

    ref.sampler.set_rnd(doc_seed(5))
    ctx = ref.fewshot_context(ref.test_docs()[5], num_fewshot=5)
    (s,) = build_gsm8k(taskset, [5])
    assert s.prompt == ctx


def test_stratified_subset_is_seeded_proportional_and_nested(taskset):
    a = select_mmlu(taskset, 300, seed=1)
    assert a == select_mmlu(taskset, 300, seed=1) and a != select_mmlu(taskset, 300, seed=2)
    assert len(a) == 300 and len(set(a)) == 300
    sizes = {s: len(MMLU.rows(taskset, s, "test")) for s in MMLU_SUBJECTS}
    per = {s: sum(1 for x, _ in a if x == s) for s in MMLU_SUBJECTS}
    total = sum(sizes.values())
    assert all(abs(per[s] - 300 * sizes[s] / total) < 1 for s in MMLU_SUBJECTS)
    bigger = set(select_mmlu(taskset, 600, seed=1))
    assert sum(1 for x in a if x in bigger) >= 290  # largest remainder: (almost) nested
    assert allocate({"a": 3, "b": 1}, 10, 0) == {"a": 3, "b": 1}
    assert select_gsm8k(taskset, 5, seed=1) == select_gsm8k(taskset, 5, seed=1)
    assert set(select_gsm8k(taskset, 5, seed=1)) <= set(select_gsm8k(taskset, 50, seed=1))


def test_prompt_hash_stable_and_sensitive(taskset, eval_data):
    s1 = build_gsm8k(taskset, [3])[0]
    s2 = build_gsm8k(TaskSet(eval_data, max_gen_toks=8), [3])[0]
    s3 = build_gsm8k(TaskSet(eval_data, max_gen_toks=9), [3])[0]
    assert s1.prompt_hash == s2.prompt_hash != s3.prompt_hash


def test_hub_path_loads_cais_mmlu_per_subject_and_openai_gsm8k(monkeypatch, eval_data):
    """No network here: stand in for datasets.load_dataset and check what the hub path asks for."""
    import datasets

    from dpep_parity.evals.data import load_data

    calls = []

    def fake_load_dataset(path, name=None, **kw):
        calls.append((path, name))
        if path == "cais/mmlu":
            return {sp: [{k: v for k, v in r.items() if k != "subject"}
                         for r in eval_data.rows("mmlu", sp) if r["subject"] == name]
                    for sp in ("test", "dev")}
        assert (path, name) == ("openai/gsm8k", "main")
        return {sp: eval_data.rows("gsm8k", sp) for sp in ("test", "train")}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hub = load_data(None)
    assert hub.source == "hub"
    assert calls == [("cais/mmlu", s) for s in MMLU_SUBJECTS] + [("openai/gsm8k", "main")]
    assert hub.rows("mmlu", "test") == eval_data.rows("mmlu", "test")
    assert hub.rows("gsm8k", "test") == eval_data.rows("gsm8k", "test")

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="could not load .* hub .*--data-dir"):
        load_data(None, ("gsm8k",))
