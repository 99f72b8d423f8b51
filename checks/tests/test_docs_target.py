"""The minimal outside target printed in docs/targets.md runs as written, and the suite catches it when
it is broken (the negative control: the per-rank division by tp removed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from dpep_parity.checks.core.batches import Batch, Request
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.harness.world import close_all
from dpep_parity.checks.judge.parity import run_example
from dpep_parity.fixtures.build import fixture_path

DOC = Path(__file__).resolve().parents[2] / "docs" / "targets.md"


@pytest.fixture
def doc_target(tmp_path, monkeypatch):
    code = re.search(r"```python\n# mypkg/naive_target.py\n(.*?)```", DOC.read_text(), re.S).group(1)
    (tmp_path / "doc_naive_target.py").write_text(code)
    (tmp_path / "doc_naive_broken.py").write_text(re.sub(r"\n *y = y / env.layout.tp\n", "\n", code))
    monkeypatch.syspath_prepend(str(tmp_path))
    close_all()          # rank processes inherit sys.path when they are spawned
    yield
    close_all()


def test_docs_minimal_target(doc_target):
    model = str(fixture_path("qwen2-moe-shared"))
    batch = Batch(((Request(0, 3), Request(2, 2)),), seed=4)
    res = run_example("doc_naive_target:TARGET", "moe", model, Layout(2), batch, "float32", layer=1)
    assert res.ok, res.report()
    skipped = run_example("doc_naive_target:TARGET", "moe", model, Layout(2, 2), Batch(((), ())), "float32")
    assert skipped.skipped == "no DP attention path"
    broken = run_example("doc_naive_broken:TARGET", "moe", model, Layout(2), batch, "float32", layer=1)
    assert not broken.ok and "parity" in {c.prop for c in broken.failures()}
    assert abs(broken.verdict.ratio - 2.0) < 0.05     # the reduction counted twice: |sut| = 2 |truth|
