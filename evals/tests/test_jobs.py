"""Sign-off runs served several at once (`signoff --jobs`, evals/jobs.py), each in a process of its own.

Positive control: two runs at once give the records and verdicts of the same runs one after another (the
serial path, `--jobs 1`). Negative controls: a run that fails in its job process is named with its error and
exits 3 while the run beside it keeps its cached work; a Ctrl-C in a job exits 130 naming the configuration.
The default is several jobs only when every run's engine says it can share the machine."""
from __future__ import annotations

import json
import os

import pytest

from dpep_parity.evals.__main__ import main
from dpep_parity.evals.jobs import default_jobs
from dpep_parity.evals.matrix import load_matrix

LIMITS = ["--mmlu-limit", "24", "--gsm8k-limit", "4", "--max-gen-toks", "8", "--no-progress", "--margin", "10"]


def matrix(path, model, second: str):
    path.write_text(f"""
[defaults]
model = "{model}"
engine = "inproc"

[[config]]
name = "base"
baseline = true
target = "hf"

[[config]]
name = "second"
{second}
""")
    return path


def records(out) -> dict:
    r = json.loads((out / "signoff.json").read_text())
    return {(c["config"], c["task"]): (c["verdict"], c["b_base_only"], c["c_cfg_only"], c["delta"], c["n"])
            for c in r["comparisons"]}


@pytest.mark.slow
def test_two_runs_at_once_give_the_records_and_verdicts_of_one_after_another(tmp_path, tiny_model, data_dir,
                                                                             capsys):
    m = matrix(tmp_path / "m.toml", tiny_model, 'target = "hf"')
    got = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out),
                   "--jobs", str(jobs), *LIMITS])
        said = capsys.readouterr().out
        got[jobs] = (rc, records(out))
        assert ("2 at once" in said) == (jobs == 2), said
    assert got[1] == got[2] and got[1][1], got


@pytest.mark.slow
@pytest.mark.parametrize("factory,rc,said", [
    ("crashing_engine", 3, ["configuration 'second' failed: SimulatedCrash: simulated engine failure"]),
    ("interrupting_engine", 130, ["interrupted during configuration 'second'", "rerun the same command"]),
])
def test_a_job_that_fails_or_is_interrupted_is_named(tmp_path, tiny_model, data_dir, capsys, factory, rc, said):
    """A failure lets the run beside it finish (its records are cached); a Ctrl-C stops it too."""
    m = matrix(tmp_path / "m.toml", tiny_model, f'factory = "evals.tests.helpers:{factory}"')
    out = tmp_path / "o"
    assert main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out), "--jobs", "2",
                 *LIMITS]) == rc
    err = capsys.readouterr().err
    assert all(s in err for s in said), err
    if rc == 130:
        return
    cached = list(out.rglob("base/mmlu.jsonl"))               # the baseline's records, cached by its own job
    assert cached and cached[0].read_text().count("\n") == 24, sorted(str(p) for p in out.rglob("*"))


def test_several_jobs_by_default_only_when_every_engine_can_share_the_machine(tmp_path, tiny_model):
    shared = load_matrix(matrix(tmp_path / "a.toml", tiny_model, 'target = "hf"')).configs
    alone = load_matrix(matrix(tmp_path / "b.toml", tiny_model,
                               'factory = "evals.tests.helpers:counting_engine"')).configs
    assert default_jobs(alone) == 1                    # a plug-in factory's engine is unknown: it runs alone
    assert 1 <= default_jobs(shared) <= len(shared)
    assert default_jobs(shared) == min(2, len(os.sched_getaffinity(0)))
