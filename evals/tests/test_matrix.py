from __future__ import annotations

import pytest

from dpep_parity.evals.matrix import MatrixError, load_matrix, parse, resolve_models
from dpep_parity.evals.signoff import DEFAULT_MATRIX


def _problems(data) -> str:
    with pytest.raises(MatrixError) as e:
        parse(data)
    return str(e.value)


def test_fixture_default_matrix_parses():
    m = load_matrix(DEFAULT_MATRIX)
    assert m.baseline.name == "tp1"
    layouts = [(c.tp, c.dp, c.ep) for c in m.ordered()]
    assert layouts == [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 4, 4)]
    assert {c.engine for c in m.configs} == {"inproc"} and {c.options.target for c in m.configs} == {"spec"}
    assert {c.model for c in m.configs} == {"fixture:qwen2-moe-shared"}
    assert {t: m.gate.margin_for(t) for t in ("mmlu", "gsm8k", "gsm8k-gold")} == \
        {"mmlu": 1.0, "gsm8k": 2.0, "gsm8k-gold": 1.0}
    assert {c.dtype for c in m.configs} == {"bfloat16"}


def test_sglang_cpu_matrix_parses():
    m = load_matrix(DEFAULT_MATRIX.with_name("sglang-cpu.toml"))
    assert m.baseline.options.target == "hf"
    assert {c.options.target for c in m.configs if not c.baseline} == {"sglang"}
    assert {(c.tp, c.dp, c.ep) for c in m.configs} >= {(2, 2, 1), (4, 2, 2), (4, 4, 4)}


def test_each_rule_is_named():
    msg = _problems({"config": [
        {"name": "a", "baseline": True, "model": "m", "target": "hf"},
        {"name": "a", "model": "m", "target": "spec", "tp": 4, "dp": 3},
        {"name": "b", "model": "m", "target": "spec", "tp": 4, "ep": 3},
        {"name": "c", "model": "m", "target": "spec", "tp": 0},
        {"name": "d", "engine": "openai", "model": "m"},
        {"name": "e", "engine": "vllm", "model": "m"},
        {"name": "f", "model": "m", "target": "spec", "dtype": "fp8", "colour": "red"},
        {"name": "g", "target": "spec"},
        {"name": "h", "engine": "inproc", "model": "m"},
        {"name": "i", "model": "m", "target": "hf", "tp": 2},
    ]})
    for fragment in ("[unique-names]", "['a']", "[tp%dp]", "tp=4, dp=3", "[tp%ep]", "tp=4, ep=3",
                     "[positive]", "config 'd': engine 'openai' needs 'base_url'", "[engine]", "'vllm'",
                     "[dtype]", "'fp8'", "[known-keys] config 'f': unknown key 'colour'",
                     "config 'g': 'model'", "config 'h': engine 'inproc' needs 'target'",
                     "target 'hf' is the single-device engine"):
        assert fragment in msg, (fragment, msg)


def test_exactly_one_baseline():
    assert "[one-baseline]" in _problems({"config": [{"name": "a", "model": "m", "target": "hf"}]})
    msg = _problems({"config": [{"name": "a", "baseline": True, "model": "m", "target": "hf"},
                                {"name": "b", "baseline": True, "model": "m", "target": "hf"}]})
    assert "[one-baseline]" in msg and "found 2" in msg


def test_gate_settings_validated():
    msg = _problems({"gate": {"margin": -1, "alpha": 0.7, "gsm8k_metric": "exact", "typo": 1},
                     "config": [{"name": "a", "baseline": True, "model": "m", "target": "hf"}]})
    for fragment in ("margin must be a positive", "alpha must be in", "gsm8k_metric", "unknown key 'typo'"):
        assert fragment in msg


def test_sglang_and_openai_fields():
    msg = _problems({"config": [{"name": "a", "baseline": True, "model": "m", "engine": "sglang",
                                 "base_url": "http://x", "server_args": "--foo"}]})
    assert "starts its own server" in msg and "server_args must be a list of strings" in msg


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "m.toml"
    bad.write_text("[[config]\nname=")
    with pytest.raises(MatrixError, match="not valid TOML"):
        load_matrix(bad)
    with pytest.raises(MatrixError, match="cannot read"):
        load_matrix(tmp_path / "nope.toml")


def test_yaml_matrix(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("config:\n  - {name: base, baseline: true, model: m, target: hf}\n"
                 "  - {name: dpa, model: m, engine: sglang, tp: 4, dp: 4, ep: 4}\n")
    m = load_matrix(f)
    assert [c.layout for c in m.ordered()] == ["tp=1 dp=1 ep=1", "tp=4 dp=4 ep=4"]


def test_model_paths_resolved_or_reported(tmp_path, tiny_model):
    f = tmp_path / "m.toml"
    f.write_text(f"""
[[config]]
name = "base"
baseline = true
model = "{tiny_model}"
target = "hf"
[[config]]
name = "missing"
model = "{tmp_path / 'nope'}"
target = "hf"
[[config]]
name = "hub"
engine = "sglang"
model = "Qwen/Qwen1.5-MoE-A2.7B"
[[config]]
name = "nocfg"
model = "{tmp_path}"
target = "hf"
""")
    m = load_matrix(f)
    with pytest.raises(MatrixError) as e:
        resolve_models(m)
    msg = str(e.value)
    assert "config 'missing'" in msg and "does not exist" in msg
    assert "config 'nocfg'" in msg and "no config.json" in msg
    assert "config 'hub'" not in msg and "config 'base'" not in msg
