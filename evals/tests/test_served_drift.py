"""The sign-off's served-drift stage (evals.signoff.served_drift_rows over checks.serving.invariance): every
in-process configuration is served again under other arrival orders, DP dispatch and concurrency. A target that
promises batch and placement invariance and keeps it passes (the batch-invariant spec); one that promises it and
breaks it FAILs its configuration with a finding, though its accuracy is equivalent (invariance mutant I02, the
expert sum ordered by token count); a target that promises nothing has its drift reported as information only."""
from __future__ import annotations

import json

import pytest

from dpep_parity.evals.__main__ import main

MATRIX = """
[defaults]
model = "fixture:qwen3-moe"
engine = "inproc"
target = "checks.catalog.variants:BATCH_INVARIANT"
dtype = "float32"

[gate]
bootstrap = 0
symmetry_draws = 1000

[[config]]
name = "tp1"
baseline = true

[[config]]
name = "tp2-dp2-ep2"
tp = 2
dp = 2
ep = 2

[[config]]
name = "tp2-dp2-ep2-I02"
target = "checks.catalog.invariance_mutants:I02"
tp = 2
dp = 2
ep = 2

[[config]]
name = "tp2-dp2-ep2-spec"
target = "spec"
tp = 2
dp = 2
ep = 2
"""


@pytest.mark.slow
def test_a_broken_invariance_promise_fails_and_drift_is_otherwise_reported(tmp_path, data_dir, capsys):
    m = tmp_path / "m.toml"
    m.write_text(MATRIX)
    out = tmp_path / "out"
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out), "--tasks", "gsm8k",
               "--gsm8k-limit", "8", "--max-gen-toks", "2", "--no-progress", "--torch-threads", "1",
               "--allow-inconclusive"])
    printed = capsys.readouterr().out
    rep = json.loads((out / "signoff.json").read_text())
    drift = {d["config"]: d for d in rep["served_drift"]}
    verdicts = {c["name"]: c["verdict"] for c in rep["configs"]}
    assert set(drift) == {"tp1", "tp2-dp2-ep2", "tp2-dp2-ep2-I02", "tp2-dp2-ep2-spec"}
    assert drift["tp2-dp2-ep2"]["promised"] and not drift["tp2-dp2-ep2"]["broken"]
    assert all(v["changed"] == 0 for v in drift["tp2-dp2-ep2"]["variants"])
    assert drift["tp2-dp2-ep2-I02"]["promised"] and drift["tp2-dp2-ep2-I02"]["broken"]
    assert verdicts["tp2-dp2-ep2-I02"] == "FAIL" and verdicts["tp2-dp2-ep2"] != "FAIL"
    assert any(f.startswith("INVARIANCE PROMISE BROKEN on tp2-dp2-ep2-I02") for f in rep["findings"])
    # the plain spec promises nothing: its drift (which it has at this layout in float32) is information
    spec = drift["tp2-dp2-ep2-spec"]
    assert not spec["promised"] and not spec["broken"] and verdicts["tp2-dp2-ep2-spec"] != "FAIL"
    assert any(v["changed"] for v in spec["variants"]), spec
    assert rc == 1 and rep["verdict"] == "FAIL"
    assert "served drift, tp2-dp2-ep2-spec:" in printed
    assert "## Served drift" in (out / "signoff.md").read_text()
