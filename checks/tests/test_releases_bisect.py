"""The release registry, `dpep bisect` and the museum's records: no sglang, no rank process (a fake runner
stands in for a release's run; the real runs are in CI's museum step and docs/museum.md)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dpep_parity.checks.targets.sglang import envs, museum, releases
from dpep_parity.checks.tools import bisect

R = releases.Release


def _rels(n: int) -> list:
    return [R(f"9.9.{i}", "2026-01-01", "layer_boundary") for i in range(n)]


def test_release_order_puts_posts_after_their_release():
    keys = [releases.version_key(v) for v in ("0.5.9", "0.5.10", "0.5.10.post1", "0.5.11")]
    assert keys == sorted(keys)
    assert [r.key for r in releases.RELEASES] == sorted(r.key for r in releases.RELEASES)


@pytest.mark.parametrize("text, says", [
    ("0.5.99..0.5.23", "not a release the sglang target knows"),
    ("0.5.23..0.5.21", "is empty"),
    ("0.5.2..0.5.7", "holds no release the sglang target supports"),
    ("banana", "not an sglang release number"),
])
def test_bad_release_ranges_are_named(text, says):
    with pytest.raises(releases.UnknownRelease, match=says):
        releases.parse_range(text)


def test_a_range_keeps_only_the_supported_releases_oldest_first():
    got = [r.version for r in releases.parse_range("0.5.18..0.5.23")]
    assert got == [r.version for r in releases.supported() if r.key >= releases.version_key("0.5.18")]
    assert got == sorted(got, key=releases.version_key)


@pytest.mark.parametrize("n", range(1, 8))
def test_bisect_finds_every_boundary_position(n, tmp_path, monkeypatch):
    """Exhaustive over the boundary's place (and no boundary), both directions: the first release whose
    verdict differs from the oldest's, within ceil(log2(n)) + 2 runs."""
    rels = _rels(n)
    for at in range(n + 1):                      # at == n: every release alike (no boundary)
        for before, after in (("PASS", "FAIL"), ("FAIL", "PASS")):
            runs = []

            def fake(query, version, timeout, log, env=None, at=at, before=before, after=after, runs=runs):
                runs.append(version)
                i = int(version.rsplit(".", 1)[1])
                return {"verdict": after if i >= at and at > 0 else before, "rc": 0, "seconds": 0.0,
                        "evidence": ""}
            monkeypatch.setattr(bisect, "run_release", fake)
            q = bisect.Query("pytest", ("x",))
            res = bisect.bisect(q, rels, bisect.State(tmp_path / f"s{n}-{at}-{before}.json", q), 1.0,
                                log=lambda m: None)
            if 0 < at < n:
                assert res["found"] and res["at"] == f"9.9.{at}" and res["before"] == f"9.9.{at - 1}"
                assert res["kind"] == ("first bad release" if before == "PASS" else "first fixed release")
            else:
                assert not res["found"] and not res["error"]
            assert len(runs) == len(set(runs)) <= (n - 1).bit_length() + 2


def test_bisect_resumes_from_its_state_file(tmp_path, monkeypatch):
    rels, q = _rels(5), bisect.Query("pytest", ("x",))
    calls = []

    def fake(query, version, timeout, log, env=None):
        calls.append(version)
        return {"verdict": "FAIL" if version >= "9.9.3" else "PASS", "rc": 0, "seconds": 0.0, "evidence": ""}
    monkeypatch.setattr(bisect, "run_release", fake)
    path = tmp_path / "state.json"
    first = bisect.bisect(q, rels, bisect.State(path, q), 1.0, log=lambda m: None)
    n = len(calls)
    again = bisect.bisect(q, rels, bisect.State(path, q), 1.0, log=lambda m: None)
    assert first == again and first["at"] == "9.9.3" and len(calls) == n      # nothing ran again
    other = bisect.Query("pytest", ("y",))                                    # another query: fresh state
    assert bisect.State(path, other).verdicts == {}
    assert json.loads(path.read_text())["query"] == q.text


def test_an_error_verdict_stops_the_search_without_a_boundary(tmp_path, monkeypatch):
    monkeypatch.setattr(bisect, "run_release", lambda *a, **k: {"verdict": "ERROR", "rc": 124, "seconds": 0.0,
                                                                 "evidence": "timed out"})
    q = bisect.Query("pytest", ("x",))
    assert bisect.bisect(q, _rels(4), bisect.State(tmp_path / "s.json", q), 1.0, log=lambda m: None)["error"]


@pytest.mark.parametrize("args, says", [
    (["--releases", "0.5.99..0.5.23", "--pytest", "x"], "not a release the sglang target knows"),
    (["--releases", "0.5.2..0.5.7", "--pytest", "x"], "holds no release"),
    (["--releases", "0.5.21..0.5.23", "--replay", "dpep replay --unit moe --fixture nope --layout tp1-dp1-ep1 "
      "--batch 'dp0:0+3 seed=1'"], "--fixture 'nope' is unknown"),
    (["--releases", "0.5.21..0.5.23", "--replay", "dpep replay --unit moe --layout tp1"], "does not parse"),
    (["--releases", "0.5.22..0.5.23", "--pytest", "x", "--property", "crash"], "--property 'crash' is not"),
    (["--releases", "0.5.22..0.5.23", "--pytest", "x", "--env", "NO_EQUALS"], "is not NAME=VALUE"),
])
def test_bisect_refuses_bad_input_before_anything_installs(args, says, capsys, monkeypatch):
    monkeypatch.setattr(envs, "install", lambda *a, **k: pytest.fail("an environment would have been built"))
    monkeypatch.setattr(bisect, "run_release", lambda *a, **k: pytest.fail("a release would have run"))
    with pytest.raises(SystemExit) as e:
        bisect.main(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_bisect_refuses_a_range_whose_adapter_misses_the_unit(capsys, monkeypatch):
    # Every release 0.5.8-0.5.23 reaches all four units today; a release whose adapter lacks one (a new era
    # not yet adapted) must be refused before any environment is built, naming the release and the reason.
    from dpep_parity.checks.targets.sglang import eras
    real = eras.adapter

    def adapter(version):
        ad = real(version)
        if version != "0.5.22":
            return ad
        return SimpleNamespace(units=tuple(u for u in ad.units if u != "moe"),
                               unreached={"moe": "no MoE step in this era"})
    monkeypatch.setattr(eras, "adapter", adapter)
    monkeypatch.setattr(envs, "install", lambda *a, **k: pytest.fail("an environment would have been built"))
    monkeypatch.setattr(bisect, "run_release", lambda *a, **k: pytest.fail("a release would have run"))
    with pytest.raises(SystemExit) as e:
        bisect.main(["--releases", "0.5.21..0.5.23", "--replay", "python -m checks.tools.replay --target sglang "
                     "--unit moe --fixture qwen3-moe --layout tp1-dp1-ep1 --batch 'dp0:0+3 seed=1'"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "sglang 0.5.22 does not reach unit 'moe': no MoE step in this era" in err
    assert "0.5.21 does not reach" not in err and "0.5.23 does not reach" not in err


def test_envs_refuse_an_unsupported_release_before_building(monkeypatch, tmp_path):
    monkeypatch.setenv("DPEP_SGLANG_ENVS", str(tmp_path))
    monkeypatch.setattr(envs, "_run", lambda *a, **k: pytest.fail("a command would have run"))
    with pytest.raises(releases.UnknownRelease, match="vLLM"):
        envs.install("0.5.5")
    assert not any(tmp_path.iterdir())


def test_every_exhibit_is_complete_and_every_caught_query_parses():
    assert museum.EXHIBITS
    for ex in museum.EXHIBITS.values():
        releases.version_key(ex.fixed) if ex.fixed else None
        for v in ex.shipped:
            releases.version_key(v)
        if ex.status == museum.CAUGHT:
            q = museum.parsed_query(ex)
            assert q.kind in ("replay", "pytest") and ex.prop
            assert museum.plan(ex), f"{ex.id}: caught, yet no release it names is reachable"
        assert ex.evidence and ex.upstream and ex.mechanism


def test_recall_counts_every_exhibit_misses_and_pending_included():
    caught, total = museum.recall()
    assert total == len(museum.EXHIBITS)
    assert caught == sum(e.status == museum.CAUGHT for e in museum.EXHIBITS.values()) < total


def test_an_exhibit_that_is_not_caught_must_say_why():
    with pytest.raises(AssertionError, match="says why"):
        museum.Exhibit("X", "t", ("#1",), "m", "crash", ("0.5.21",), None, "e", museum.MISS)
    with pytest.raises(AssertionError, match="has a query"):
        museum.Exhibit("X", "t", ("#1",), "m", "crash", ("0.5.21",), None, "e", museum.CAUGHT)


def test_a_release_run_names_the_failed_properties_and_ignores_other_bracketed_lines(monkeypatch):
    out = ("[transformers] `BaseImageProcessorFast` is deprecated.\n"
           "[routing] rank 0: layer 1 ... not near a tie\n[parity] 3 of 3 rows beyond the bound\nFAIL\n")
    monkeypatch.setattr(envs, "python_for", lambda v: "python")
    monkeypatch.setattr(bisect.subprocess, "run",
                        lambda *a, **k: type("P", (), {"returncode": 1, "stdout": out, "stderr": ""})())
    got = bisect.run_release(bisect.Query("pytest", ("x",)), "0.5.23", 1.0, log=lambda m: None)
    assert got["verdict"] == "FAIL" and got["failed"] == ["parity", "routing"]
    assert got["evidence"].startswith("[routing]")


def test_an_exhibit_counts_only_its_own_property_failing_and_plans_its_clean_release():
    ex = museum.EXHIBITS["M23734"]
    assert museum.as_recorded(ex, "FAIL", {"verdict": "FAIL", "failed": ["parity", "dispatch"]})
    assert not museum.as_recorded(ex, "FAIL", {"verdict": "FAIL", "failed": ["dispatch"]})   # another bug
    assert not museum.as_recorded(ex, "FAIL", {"verdict": "ERROR", "failed": []})            # harness error
    assert museum.as_recorded(ex, "PASS", {"verdict": "PASS", "failed": []})
    assert museum.plan(ex) == [("0.5.9", "PASS"), ("0.5.10", "FAIL"), ("0.5.10.post1", "FAIL"), ("0.5.11", "PASS")]


def test_every_fixed_exhibit_names_reachable_releases_on_both_sides():
    """The acceptance of docs/museum.md: a caught exhibit with a fix is checked failing where it shipped and
    passing where it was fixed, both inside the releases the target runs."""
    reach = {r.version for r in releases.supported()}
    fixed = [e for e in museum.EXHIBITS.values() if e.status == museum.CAUGHT and e.fixed]
    assert len(fixed) >= 6
    for e in fixed:
        assert e.fixed in reach and any(v in reach for v in e.shipped), e.id


def _result(layout: str, batch: str, *checks):
    from dpep_parity.checks.core.batches import parse_batch
    from dpep_parity.checks.core.topology import Layout
    from dpep_parity.checks.judge.parity import Check, ParityResult
    res = ParityResult("moe", Layout.parse(layout), parse_batch(batch), "float32")
    res.checks = [Check(p, False, m) for p, m in checks]
    return res


def test_a_museum_bug_explains_its_own_signature_on_the_releases_that_shipped_it_only():
    crash = ("no-crash", "File parallel_state.py ... assert len(sizes) == self.world_size\nAssertionError")
    doubled = ("parity", "2 of 2 rows beyond the bound; |sut|/|truth| = 2.0000")
    decode = "dp0:4+1 dp1:3+1 seed=5"
    assert museum.explaining(_result("tp4-dp2-ep2", decode, crash), "qwen3-moe", "0.5.12").id == "M32663"
    assert museum.explaining(_result("tp2-dp2-ep2", decode, doubled), "qwen3-moe", "0.5.10").id == "M23734"
    # negative controls: another release, another layout, another check, another padding mode, another model
    assert museum.explaining(_result("tp4-dp2-ep2", decode, crash), "qwen3-moe", "0.5.17") is None
    assert museum.explaining(_result("tp2-dp2-ep2", decode, crash), "qwen3-moe", "0.5.12") is None
    assert museum.explaining(_result("tp4-dp2-ep2", decode, crash, doubled), "qwen3-moe", "0.5.12") is None
    assert museum.explaining(_result("tp2-dp2-ep2", "dp0:0+3 dp1:0+2 seed=5", doubled), "qwen3-moe",
                             "0.5.10") is None                                   # SUM_LEN: no reduce-scatter
    assert museum.explaining(_result("tp2-dp2-ep2", decode, doubled), "qwen2-moe-shared", "0.5.10") is None
    assert museum.explaining(_result("tp2-dp2-ep2", decode, ("no-crash", "x")), "qwen3-moe", "0.5.10") is None


def test_a_property_bisect_reads_another_propertys_failure_as_pass(tmp_path, monkeypatch):
    """9.9.1 - 9.9.2 fail by `dispatch` only (a second bug), 9.9.3 on fails by `no-crash`: with --property
    no-crash the first bad release is 9.9.3; without it, 9.9.1."""
    def fake(query, version, timeout, log, env=None):
        i = int(version.rsplit(".", 1)[1])
        failed = ["no-crash"] if i >= 3 else ["dispatch"] if i >= 1 else []
        return {"verdict": "FAIL" if failed else "PASS", "rc": int(bool(failed)), "seconds": 0.0,
                "evidence": "", "failed": failed}
    monkeypatch.setattr(bisect, "run_release", fake)
    q, rels = bisect.Query("pytest", ("x",)), _rels(5)
    assert bisect.bisect(q, rels, bisect.State(tmp_path / "a.json", q), 1.0, log=lambda m: None,
                         prop="no-crash")["at"] == "9.9.3"
    assert bisect.bisect(q, rels, bisect.State(tmp_path / "b.json", q), 1.0, log=lambda m: None)["at"] == "9.9.1"


def test_a_passing_run_is_evidenced_by_its_own_verdict_line_not_a_warning_at_exit(monkeypatch):
    err = "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: leaked semaphore\n  warnings.warn(\n"
    monkeypatch.setattr(envs, "python_for", lambda v: "python")
    monkeypatch.setattr(bisect.subprocess, "run",
                        lambda *a, **k: type("P", (), {"returncode": 0, "stdout": "all properties hold\nPASS\n",
                                                       "stderr": err})())
    got = bisect.run_release(bisect.Query("pytest", ("x",)), "0.5.23", 1.0, log=lambda m: None)
    assert got["verdict"] == "PASS" and got["failed"] == [] and got["evidence"] == "PASS"
