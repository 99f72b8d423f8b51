from __future__ import annotations

import json

from dpep_parity.evals.cache import SampleCache, fingerprint
from dpep_parity.evals.matrix import Config


def rec(i):
    return {"doc_id": f"d{i}", "prompt_hash": f"h{i}", "metrics": {"acc": 1.0}}


def test_append_reload_and_fingerprint(tmp_path):
    c = SampleCache(tmp_path, "cfg", "mmlu", "fp1")
    c.append([rec(0), rec(1)])
    again = SampleCache(tmp_path, "cfg", "mmlu", "fp1")
    assert again.get("d1", "h1") == rec(1) and again.get("d1", "other-prompt") is None
    other = SampleCache(tmp_path, "cfg", "mmlu", "fp2")
    assert other.records == {} and other.stale == 2


def test_line_cut_by_a_kill_is_removed_reported_and_appending_resumes_cleanly(tmp_path, capsys):
    c = SampleCache(tmp_path, "cfg", "gsm8k", "fp")
    c.append([rec(0)])
    with open(c.path, "a") as fh:
        fh.write('{"doc_id": "d1", "prompt_ha')  # killed mid-write
    c2 = SampleCache(tmp_path, "cfg", "gsm8k", "fp")
    assert list(c2.records) == [("d0", "h0")] and c2.torn == 1
    assert "removed 1 line(s) cut short by an interrupted write" in capsys.readouterr().err
    assert [json.loads(x)["doc_id"] for x in c2.path.read_text().splitlines()] == ["d0"]   # repaired on disk
    c2.append([rec(1)])
    lines = c2.path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[-1])["doc_id"] == "d1"
    assert SampleCache(tmp_path, "cfg", "gsm8k", "fp").torn == 0
    assert set(SampleCache(tmp_path, "cfg", "gsm8k", "fp").records) == {("d0", "h0"), ("d1", "h1")}


def test_fingerprint_tracks_what_changes_answers(tiny_model):
    flat = {"name": "a", "model": "m", "target": "hf", "model_path": str(tiny_model)}
    base, same = Config.make(**flat), Config.make(**flat)
    assert fingerprint(base, 8) == fingerprint(same, 8)
    assert fingerprint(base, 8) != fingerprint(base, 16)
    for change in ({"dtype": "bfloat16"}, {"tp": 2}, {"replica": 1}, {"target": "spec"}, {"serving": "prefill"}):
        other = Config.make(**{**flat, **change})
        assert fingerprint(other, 8) != fingerprint(base, 8), change
