"""End-to-end sign-offs on the tiny model: pass, fail with reasons, resume, bad input, report files."""
from __future__ import annotations

import json

import pytest

from dpep_parity.evals.__main__ import main
from dpep_parity.evals.tests import helpers

LIMITS = ["--mmlu-limit", "40", "--gsm8k-limit", "5", "--max-gen-toks", "8", "--no-progress"]


def write_matrix(path, model, candidate_factory="counting_engine", gate=""):
    path.write_text(f"""
[defaults]
model = "{model}"
engine = "inproc"

[gate]
{gate}

[[config]]
name = "base"
baseline = true
target = "hf"

[[config]]
name = "candidate"
factory = "evals.tests.helpers:{candidate_factory}"
tp = 2
dp = 2
""")
    return path


@pytest.fixture
def counting():
    helpers.CALLS["sequences"] = 0
    helpers.CRASH_AFTER["sequences"] = None
    yield helpers.CALLS
    helpers.CRASH_AFTER["sequences"] = None


@pytest.fixture(scope="module")
def shared_out(tmp_path_factory):
    """One output dir for the pass/fail runs: the baseline is computed once and then read from cache."""
    return tmp_path_factory.mktemp("signoff")


def _report(out):
    return json.loads((out / "signoff.json").read_text())


def test_identical_engines_pass(tmp_path, tiny_model, data_dir, shared_out, counting, capsys):
    m = write_matrix(tmp_path / "m.toml", tiny_model)
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(shared_out),
               "--margin", "10", "--aa", *LIMITS])
    out = capsys.readouterr().out
    assert rc == 4, out                                                # INCONCLUSIVE: not signed off
    rep = _report(shared_out)
    by = {(c["config"], c["task"]): c for c in rep["comparisons"]}
    assert by[("candidate", "mmlu")]["verdict"] == "PASS"
    assert by[("candidate", "gsm8k")]["verdict"] == "INCONCLUSIVE"  # 5 items cannot show +-10 pts
    assert rep["verdict"] == "INCONCLUSIVE"
    for c in rep["comparisons"]:
        assert c["agreement"] == 1.0 and c["b_base_only"] == c["c_cfg_only"] == 0
    assert ("base~aa", "mmlu") in by and any("A/A identical" in n for n in rep["aa"])
    assert "Sample sizes before the run" in out and "drop the difference test detects" in out
    assert out.index("Sample sizes before the run") < out.index("Verdict:")
    for f in ("signoff.md", "signoff.json", "signoff.png"):
        assert (shared_out / f).stat().st_size > 0
    md = (shared_out / "signoff.md").read_text()
    assert "| candidate |" in md and "A/A" in md and "INCONCLUSIVE" in md
    # --allow-inconclusive accepts the undecided GSM8K (exit 0), with nothing recomputed
    counting["sequences"] = 0
    assert main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(shared_out),
                 "--margin", "10", "--allow-inconclusive", *LIMITS]) == 0
    assert counting["sequences"] == 0


def test_biased_engine_fails_and_says_why(tmp_path, tiny_model, data_dir, shared_out, counting, capsys):
    m = write_matrix(tmp_path / "m.toml", tiny_model, "biased_engine")
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(shared_out), *LIMITS])
    out = capsys.readouterr().out
    assert rc == 1, out
    rep = _report(shared_out)
    mmlu = next(c for c in rep["comparisons"] if c["task"] == "mmlu")
    assert mmlu["verdict"] == "FAIL" and rep["verdict"] == "FAIL"
    assert any("answers shift systematically" in r and f"->{helpers.BIAS['letter']}" in r for r in mmlu["reasons"]), mmlu["reasons"]
    assert "answers shift systematically" in (shared_out / "signoff.md").read_text()
    assert "Verdict: FAIL" in out


def test_scaled_logits_fail_a_declared_drift_ceiling(tmp_path, tiny_model, data_dir, shared_out, counting):
    m = write_matrix(tmp_path / "m.toml", tiny_model, "scaled_engine", gate="max_logprob_drift = 0.01")
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(shared_out),
               "--tasks", "mmlu", *LIMITS])
    assert rc == 1
    (mmlu,) = _report(shared_out)["comparisons"]
    assert mmlu["agreement"] == 1.0  # scaling keeps every argmax...
    assert mmlu["drift"]["mean_abs_chosen"] > 0.01  # ...but not the log-probabilities
    assert any("log-likelihood drift" in r for r in mmlu["reasons"])


@pytest.mark.slow
def test_interrupted_run_resumes_without_recomputing(tmp_path, tiny_model, data_dir, counting, capsys):
    m = write_matrix(tmp_path / "m.toml", tiny_model)
    args = ["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--tasks", "mmlu",
            "--chunk-size", "4", *LIMITS]
    # the reference: an uninterrupted run of the candidate (the baseline does not count calls)
    assert main([*args, "--out", str(tmp_path / "fresh")]) in (0, 1, 4)
    fresh = counting["sequences"]
    assert fresh > 0 and fresh % 40 == 0
    per_doc = fresh // 40

    out = tmp_path / "resume"
    counting["sequences"] = 0
    helpers.CRASH_AFTER["sequences"] = 10 * per_doc  # dies inside its third chunk of 4 documents
    assert main([*args, "--out", str(out)]) == 3  # an engine failure: exit 3, the cache kept
    assert "SimulatedCrash" in capsys.readouterr().err
    helpers.CRASH_AFTER["sequences"] = None
    cache = out / "cache" / "candidate" / "mmlu.jsonl"
    done = len(cache.read_text().splitlines())
    assert done == 8  # two whole chunks were fsynced before the crash

    counting["sequences"] = 0
    rc = main([*args, "--out", str(out)])
    assert counting["sequences"] == fresh - done * per_doc  # nothing already done is recomputed
    counting["sequences"] = 0
    assert main([*args, "--out", str(out)]) == rc
    assert counting["sequences"] == 0  # a finished run recomputes nothing at all
    a, b = _report(tmp_path / "fresh"), _report(out)
    assert [(c["acc_cfg"], c["b_base_only"], c["c_cfg_only"]) for c in a["comparisons"]] == \
           [(c["acc_cfg"], c["b_base_only"], c["c_cfg_only"]) for c in b["comparisons"]]


def test_bad_input_exits_2_before_any_work(tmp_path, tiny_model, data_dir, counting, capsys):
    m = write_matrix(tmp_path / "m.toml", tiny_model)
    assert main(["signoff", "--matrix", str(m), "--data-dir", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "o"), *LIMITS]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[config]]\nname = "a"\nmodel = "x"\ntarget = "hf"\ntp = 3\ndp = 2\n')
    assert main(["signoff", "--matrix", str(bad), "--data-dir", str(data_dir), "--out", str(tmp_path / "o"),
                 *LIMITS]) == 2
    err = capsys.readouterr().err
    assert "[tp%dp]" in err and "[one-baseline]" in err
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[[config]]\nname = "a"\nbaseline = true\nmodel = "{tiny_model}"\n'
                    'target = "no.such:thing"\n')
    assert main(["signoff", "--matrix", str(spec), "--data-dir", str(data_dir), "--out",
                 str(tmp_path / "o"), *LIMITS]) == 2
    err = capsys.readouterr().err
    assert "checks.serving.ServingEngine" in err or "cannot import 'no.such'" in err
    assert counting["sequences"] == 0 and not (tmp_path / "o" / "cache").exists()


def test_a_layout_the_model_cannot_take_exits_2_before_the_baseline_runs(tmp_path, data_dir, capsys):
    """tp = dp = ep = 3 on an 8-expert fixture used to run the baseline for a minute, then exit 3 ("rerun to
    resume") for an input that can never work."""
    m = tmp_path / "m.toml"
    m.write_text('[defaults]\nmodel = "fixture:qwen2-moe-shared"\nengine = "inproc"\ntarget = "spec"\n'
                 '[[config]]\nname = "base"\nbaseline = true\n'
                 '[[config]]\nname = "three"\ntp = 3\ndp = 3\nep = 3\n')
    assert main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(tmp_path / "o"),
                 *LIMITS]) == 2
    err = capsys.readouterr().err
    assert "config 'three': layout tp=3 dp=3 ep=3 cannot serve fixture:qwen2-moe-shared" in err
    assert "num_experts % ep == 0" in err
    assert not (tmp_path / "o" / "cache").exists()


def test_colleague_reports_are_embedded(tmp_path, tiny_model, data_dir, counting):
    out = tmp_path / "o"
    (out / "reports").mkdir(parents=True)
    (out / "reports" / "kill-table.json").write_text(json.dumps(
        [{"mutant": "double-reduce", "killed": True}, {"mutant": "skip-scatter", "killed": False}]))
    (out / "reports" / "property-suite.json").write_text(
        json.dumps({"passed": 40, "failed": 0, "cases": [1, 2]}))
    m = write_matrix(tmp_path / "m.toml", tiny_model)
    main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out), "--tasks", "gsm8k",
          "--gsm8k-limit", "2", "--max-gen-toks", "4", "--no-progress"])
    md = (out / "signoff.md").read_text()
    assert "kill-table.json" in md and "by killed" in md
    assert "property-suite.json" in md and "passed: 40" in md


def test_ctrl_c_exits_130_and_says_how_to_resume(tmp_path, tiny_model, data_dir, counting, capsys):
    m = write_matrix(tmp_path / "m.toml", tiny_model)
    helpers.INTERRUPT["after"] = 30
    try:
        rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(tmp_path / "o"),
                   "--chunk-size", "8", *LIMITS])
    finally:
        helpers.INTERRUPT["after"] = None
    err = capsys.readouterr().err
    assert rc == 130
    assert "interrupted during configuration" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err


def test_a_dead_openai_server_is_bad_input_before_the_baseline_runs(tmp_path, tiny_model, data_dir, capsys):
    """An OpenAI-compatible engine on a closed port used to run the baseline first, then exit 3 ("rerun to
    resume"). Positive control: test_server_engines' sign-off against a live server."""
    from dpep_parity.evals.engines.sglang_server import free_port
    port = free_port()                          # nothing listens there once it returns
    m = tmp_path / "m.toml"
    m.write_text(f'[defaults]\nmodel = "{tiny_model}"\n[[config]]\nname = "base"\nbaseline = true\n'
                 f'engine = "inproc"\ntarget = "hf"\n[[config]]\nname = "served"\nengine = "openai"\n'
                 f'base_url = "http://127.0.0.1:{port}"\n')
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(tmp_path / "o"), *LIMITS])
    err = capsys.readouterr().err
    assert rc == 2 and f"config 'served': no server at http://127.0.0.1:{port}" in err
    assert not (tmp_path / "o" / "cache").exists()


def test_the_property_suites_failures_are_counted_from_their_records_not_their_text():
    from dpep_parity.checks.core.records import FailedCheck, FailureRecord
    from dpep_parity.evals.report import _summarize

    rec = FailureRecord((FailedCheck("parity", "8 rows beyond"), FailedCheck("routing", "rank 2")), unit="moe")
    obj = {"summary": "2 failed", "failures": [
        {"test": "t", "records": [json.loads(rec.to_json())]},
        {"test": "u", "records": [{"schema": "dpep.failure/9", "failed": []}]},
        {"test": "v", "records": []}]}           # control: text alone ("[parity] ..." in a message) counts nothing
    assert _summarize(obj) == {"summary": "2 failed", "failed properties": {"parity": 1, "routing": 1},
                               "unreadable failure records": 1}
