"""The kill table counts only kills: a failed property of the suite, read from the failure's typed record
(checks.core.records), never from its text. Errors, timeouts and kills by a property the mutant does not declare
have their own verdicts; outside targets are accepted."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dpep_parity.checks.catalog.mutants import CATALOG
from dpep_parity.checks.core.records import FailedCheck, FailureRecord, RecordError
from dpep_parity.checks.tools.killtable import ROOT, classify, junit_failures, properties_of

PARITY_FAIL = ("AssertionError: moe tp4-dp2-ep2 float32 batch[dp0:0+3 seed=7]\n"
               "E   [parity] 8 of 8 rows beyond the bound\nE   [routing] rank 2: layer 1 routed to experts [1, 3]")
RECORD = FailureRecord((FailedCheck("parity", "8 of 8 rows beyond the bound"),
                        FailedCheck("routing", "rank 2: layer 1 routed to experts [1, 3]")),
                       unit="moe", layout="tp4-dp2-ep2", batch="dp0:0+3 seed=7", dtype="float32")
KILL = {"test": "t", "kind": "failure", "message": PARITY_FAIL, "records": [RECORD]}


def run(rc, cases=(), output=""):
    return {"rc": rc, "seconds": 1.0, "cases": list(cases), "output": output}


@pytest.mark.parametrize("rc,cases,expected,verdict", [
    (1, [KILL], ("parity",), "killed"),
    (1, [KILL], (), "killed"),
    (1, [KILL], ("liveness",), "killed-elsewhere"),
    (1, [{**KILL, "records": []}], ("parity",), "ERROR"),   # the text names [parity], no record does
    (0, [], ("parity",), "SURVIVED"),
    (None, [], ("parity",), "TIMEOUT"),
    (4, [], ("parity",), "ERROR"),                # --target that does not import: a usage error
    (2, [], ("parity",), "ERROR"),                # collection error
    (1, [{"test": "t", "kind": "error", "message": "fixture 'suite' raised ImportError"}], (), "ERROR"),
    (1, [{"test": "t", "kind": "failure", "message": "TypeError: run() missing 1 argument"}], (), "ERROR"),
], ids=["expected-property", "no-declaration", "other-property", "text-without-record", "survived", "timeout",
        "usage-error",
        "collection-error", "setup-error", "crash-without-property"])
def test_only_a_failed_property_is_a_kill(rc, cases, expected, verdict):
    """Negative control: the old table counted every non-zero exit but 5 as 'killed' (a usage error, an
    import error of the target, a timeout)."""
    v = classify(run(rc, cases), expected)
    assert v["verdict"] == verdict, v
    if verdict.startswith("killed"):
        assert v["properties"] == ["parity", "routing"]


def test_properties_are_read_from_records_only_when_known():
    rec = FailureRecord((FailedCheck("liveness", "HANG: rank 1 skipped"), FailedCheck("gate", "not ours"),
                         FailedCheck("no-crash", "x"), FailedCheck("liveness", "again")))
    assert properties_of({"records": [rec]}) == ["liveness", "no-crash"]
    assert FailureRecord.from_json(rec.to_json()) == rec


def test_a_record_of_another_version_is_refused():
    text = RECORD.to_json().replace('"dpep.failure/1"', '"dpep.failure/9"')
    with pytest.raises(RecordError, match="schema 'dpep.failure/9'"):
        FailureRecord.from_json(text)


def test_junit_failures_tell_failures_from_errors_and_carry_records(tmp_path):
    from xml.sax.saxutils import quoteattr
    f = tmp_path / "j.xml"
    f.write_text('<testsuites><testsuite><testcase classname="property_tests.test_parity" name="a"/>'
                 '<testcase classname="property_tests.test_parity" name="b"><error message="boom">tb</error>'
                 '</testcase><testcase classname="property_tests.test_parity" name="c"><properties>'
                 f'<property name="dpep_failure" value={quoteattr(RECORD.to_json())}/></properties>'
                 '<failure message="[parity] x">tb</failure></testcase></testsuite></testsuites>')
    cases = junit_failures(str(f))
    assert [(c["test"], c["kind"]) for c in cases] == [("test_parity::b", "error"), ("test_parity::c", "failure")]
    assert cases[0]["records"] == [] and cases[1]["records"] == [RECORD]


def test_every_catalog_mutant_declares_known_properties():
    from dpep_parity.checks.tools.killtable import PROPERTIES
    for m in CATALOG.values():
        assert m.kills and set(m.kills) <= set(PROPERTIES), m.id


@pytest.mark.slow
def test_outside_targets_end_to_end(tmp_path):
    """A mutant named as an outside target is killed by its declared property, a target that does not import
    is an ERROR (not a kill), and the exit code is 1 because of it (no --check needed); the spec control passes."""
    out = tmp_path / "kt"
    p = subprocess.run([sys.executable, "-m", "checks.tools.killtable", "--target", "checks.catalog.mutants:B14",
                        "--target", "no_such_pkg.mod:X", "--out", str(out), "--",
                        "-k", "test_moe_pinned", "--world-sizes", "4", "--dtypes", "float32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    t = json.loads((out / "kill-table.json").read_text())
    by = {m["id"]: m for m in t["mutants"]}
    assert t["control_passed"], t
    assert by["checks.catalog.mutants:B14"]["verdict"] == "killed" and "parity" in by["checks.catalog.mutants:B14"]["properties"]
    assert by["checks.catalog.mutants:B14"]["expected"] == list(CATALOG["B14"].kills)
    assert by["no_such_pkg.mod:X"]["verdict"] == "ERROR" and "usage error" in by["no_such_pkg.mod:X"]["message"]
    assert set(by) == {"checks.catalog.mutants:B14", "no_such_pkg.mod:X"}     # --target replaces the catalog
