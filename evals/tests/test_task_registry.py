"""The eval-task registry: the shipped tasks are found, a task registered from here reaches the data loader,
the matrix, the sign-off, the runner, the gate and the report, and MMLU through lm-eval's evaluator scores
exactly the requests its samples hash."""
from __future__ import annotations

import json

import pytest

from dpep_parity.evals import gate as G
from dpep_parity.evals import tasks
from dpep_parity.evals.data import DataError, load_local
from dpep_parity.evals.matrix import GateSettings, parse
from dpep_parity.evals.tasks.base import EvalTask
from dpep_parity.evals.tests.echo_task import EchoTask


def test_shipped_tasks_are_discovered_with_their_measures():
    assert tasks.names() == ("mmlu", "gsm8k")
    assert list(tasks.measures()) == ["mmlu", "gsm8k", "gsm8k-gold"] == list(G.MEASURES)
    assert tasks.default_margins() == {"mmlu": 1.0, "gsm8k": 2.0, "gsm8k-gold": 1.0}
    assert tasks.get("gsm8k").truth_measure == "gsm8k-gold"
    assert tasks.runner_of("gsm8k-gold") == tasks.get("gsm8k").run_truth
    # planned family per configuration: MMLU difference + symmetry; GSM8K + gold + tolerance (pooled, tail)
    assert tasks.get("mmlu").tests(True, True) == 2
    assert [tasks.get("gsm8k").tests(p, t) for p, t in ((False, False), (True, False), (True, True))] == [1, 2, 4]
    with pytest.raises(KeyError, match="unknown eval task 'nope'"):
        tasks.get("nope")


def test_a_task_may_not_take_another_tasks_measure():
    class Clash(EvalTask):
        name = "clash"
        measures = (tasks.measure("mmlu"),)

    with pytest.raises(ValueError, match=r"measures \['mmlu'\] belong to other tasks"):
        tasks.register(Clash())
    assert "clash" not in tasks.TASKS


# ------------------------------------------------------------------------------------ a task in one file
@pytest.fixture
def echo(tmp_path):
    tasks.register(EchoTask())
    d = tmp_path / "data"
    (d / "echo").mkdir(parents=True)
    (d / "echo" / "test.jsonl").write_text("".join(json.dumps({"word": w}) + "\n" for w in
                                                   ("apple", "ducks", "eggs", "Janet", "market", "the")))
    yield d
    tasks.unregister("echo")
    assert "echo" not in tasks.TASKS and "echo" not in tasks.measures()


def test_a_registered_task_reaches_data_matrix_and_gate(echo):
    data = load_local(echo, ("echo",))
    assert [r["word"] for r in data.rows("echo", "test")][:2] == ["apple", "ducks"]
    with open(echo / "echo" / "test.jsonl", "a") as fh:
        fh.write('{"word": 3}\n')
    with pytest.raises(DataError, match=r"test\.jsonl:7: echo rows need a string 'word'"):
        load_local(echo, ("echo",))
    (echo / "empty").mkdir()
    with pytest.raises(DataError, match=r"missing echo/test\.jsonl"):
        load_local(echo / "empty", ("echo",))
    assert GateSettings().margin_for("echo") == 30.0
    m = parse({"config": [{"name": "a", "baseline": True, "model": "m", "target": "hf"}],
               "gate": {"margin": {"echo": 20}}})
    assert m.gate.margin_for("echo") == 20.0 and m.gate.margin_for("mmlu") == 1.0
    recs = [{"task": "echo", "doc_id": f"echo/{i}", "prompt_hash": "h", "ll": -1.0, "metrics": {"acc": 1.0}}
            for i in range(40)]
    p = G.pair("echo", recs, recs)
    assert G.measures_of("echo", p) == ["echo"]
    c = G.compare(p, GateSettings(bootstrap=0), "config", "echo")
    G.decide([c], GateSettings())
    assert c["unit"] == "item" and c["agreement_what"] == "same log-likelihood" and c["verdict"] == "PASS"


def test_a_registered_task_signs_off_end_to_end(echo, tmp_path, tiny_model, capsys):
    from dpep_parity.evals.__main__ import main
    from dpep_parity.evals.tests.test_signoff import write_matrix

    m = write_matrix(tmp_path / "m.toml", tiny_model)
    out = tmp_path / "out"
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(echo), "--out", str(out), "--tasks", "echo",
               "--echo-limit", "5", "--no-progress"])
    printed = capsys.readouterr().out
    assert rc in (0, 4), printed
    rep = json.loads((out / "signoff.json").read_text())
    assert rep["tasks"] == ["echo"] and rep["measures"] == ["echo"]
    (cmp,) = rep["comparisons"]
    assert cmp["n"] == 5 and cmp["agreement"] == 1.0 and cmp["margin"] == 0.3
    assert len((out / "cache" / "candidate" / "echo.jsonl").read_text().splitlines()) == 5
    assert "## echo" in (out / "signoff.md").read_text()


# ------------------------------------------------------------------------------------ lm-eval's evaluator
def test_mmlu_through_lm_eval_evaluator_scores_the_hashed_requests(taskset, tiny_model):
    from dpep_parity.evals.engines.hf_local import HFForwardEngine
    from dpep_parity.evals.lm_adapter import ForwardEngineLM

    lm = ForwardEngineLM(engine=HFForwardEngine(str(tiny_model), "float32"), tokenizer=str(tiny_model))
    mmlu = tasks.get("mmlu")
    chunk = mmlu.build(taskset, [("anatomy", 3), ("virology", 0), ("anatomy", 1)])
    recs = mmlu.run(lm, taskset, chunk)
    assert [r["doc_id"] for r in recs] == ["mmlu/anatomy/3", "mmlu/virology/0", "mmlu/anatomy/1"]
    for s, r in zip(chunk, recs):
        direct = lm.loglikelihood(s.instances, disable_tqdm=True)   # the very requests the hash covers
        assert r["lls"] == pytest.approx([ll for ll, _ in direct], abs=1e-5)
        assert r["metrics"]["acc"] == float(r["pred"] == s.doc["answer"]) and r["prompt_hash"] == s.prompt_hash
    chunk[0].instances = chunk[0].instances[:3] + chunk[1].instances[3:]   # a sample whose hash lies
    with pytest.raises(RuntimeError, match="built other requests than the sample's"):
        mmlu.run(lm, taskset, chunk)
