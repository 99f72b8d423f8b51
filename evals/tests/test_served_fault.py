"""End to end, the sign-off on the fixture model in bfloat16 with a float64 truth run: faults that only decode
steps with an idle DP rank show (catalog mutants M07, M08) fail the gate, through the tolerance test of gsm8k-gold,
when the configuration is served by the serving engine; the same mutant passes that test when every token is
a full forward (serving = "prefill", how the evals ran before the serving engine). Positive control: the
correct layout served the same way. The engine's own counters show the idle-rank and MAX_LEN decode steps
happened (counted, not assumed). The full-size demonstration is evals/configs/demo-decode-mutant.toml.
"""
from __future__ import annotations

import json

import pytest

from dpep_parity.evals.__main__ import main

pytestmark = pytest.mark.slow     # a whole sub-run per test (checks/suite/tiers.py)

MATRIX = """
[defaults]
model = "fixture:qwen2-moe-shared"
engine = "inproc"
target = "spec"
dtype = "bfloat16"
in_flight = 1          # one request at a time: the other DP rank idles in every decode step

[gate]
bootstrap = 0
symmetry_draws = 2000

[[config]]
name = "tp1"
baseline = true

[[config]]
name = "tp2-dp2"
tp = 2
dp = 2

[[config]]
name = "tp2-dp2-M08-served"
target = "checks.catalog.mutants:M08"
tp = 2
dp = 2

[[config]]
name = "tp2-dp2-M07-served"
target = "checks.catalog.mutants:M07"
tp = 2
dp = 2

[[config]]
name = "tp2-dp2-M08-prefill"
target = "checks.catalog.mutants:M08"
serving = "prefill"
in_flight = 0
tp = 2
dp = 2
"""


def test_decode_only_fault_fails_served_and_passes_prefill_only(tmp_path, data_dir, capsys):
    m = tmp_path / "m.toml"
    m.write_text(MATRIX)
    out = tmp_path / "out"
    rc = main(["signoff", "--matrix", str(m), "--data-dir", str(data_dir), "--out", str(out), "--tasks", "gsm8k",
               "--gsm8k-limit", "24", "--max-gen-toks", "4", "--no-progress", "--torch-threads", "1"])
    printed = capsys.readouterr().out
    rep = json.loads((out / "signoff.json").read_text())
    gold = {c["config"]: c for c in rep["comparisons"] if c["task"] == "gsm8k-gold"}
    configs = {c["name"]: c for c in rep["configs"]}

    assert rc == 1 and rep["verdict"] == "FAIL"
    for bad in ("tp2-dp2-M08-served", "tp2-dp2-M07-served"):
        served = gold[bad]
        assert served["verdict"] == "FAIL", (bad, served["reasons"])
        assert served["error"]["tail"]["p_holm"] < 0.05 or served["error"]["p_holm"] < 0.05, served["error"]
        assert any("a computation fault" in r for r in served["reasons"])
        assert f"{bad} / gsm8k-gold: FAIL" in printed
        stats = configs[bad]["serving"]
        assert stats["idle_rank_steps"] > 0 and stats["max_len_steps"] > 0 and stats["decode_steps"] > 0

    for ok in ("tp2-dp2", "tp2-dp2-M08-prefill"):       # positive control, and the blind prefill-only engine
        e = gold[ok]["error"]
        assert e["tail"]["p_holm"] >= 0.05 and e["p_holm"] >= 0.05, (ok, e)
        assert not any("a computation fault" in r for r in gold[ok]["reasons"])
    assert configs["tp2-dp2-M08-prefill"]["serving"].get("decode_steps", 0) == 0
    assert configs["tp1~float64"]["role"] == "float64 truth" and configs["tp1~float64"]["dtype"] == "float64"


def test_prefill_only_engine_keeps_the_models_context_window():
    """The prefill-only wrapper exposes the model directory, so the LM adapter cuts prompts at the model's
    context window as it does for the served engine (it once fell back to 4096 tokens: other prompts)."""
    from dpep_parity.evals.engines.inproc import PrefillOnly
    from dpep_parity.evals.lm_adapter import ForwardEngineLM
    from dpep_parity.fixtures.build import fixture_path

    class Served:
        name, model_dir = "served", str(fixture_path("qwen2-moe-shared"))

        def forward(self, requests):
            raise AssertionError("not called")

    served = ForwardEngineLM(engine=Served())
    prefill = ForwardEngineLM(engine=PrefillOnly(Served()))
    assert prefill.max_length == served.max_length == 256
