"""The repository's test tiers (checks/suite/tiers.py): the quick tier (the README's test command) deselects the
tests marked slow, `--tier slow` runs only those, `--tier all` both, so CI's two commands run every test once;
a test named by node id runs whatever its tier. Run by pytester on a two-test directory with only the tiers
plugin (the suite's plugin off: nothing of torch to import).

Negative control: the slow test does not run in the quick tier (and the quick test not in the slow tier).
Positive control: everything runs with --tier all, and a slow test named by id runs in the quick tier."""
from __future__ import annotations

import pytest

TESTS = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_slow():
    pass
"""
PLUGINS = ("-p", "no:dpep", "-p", "dpep_parity.checks.suite.tiers")
TARGET_OPTION = """
def pytest_addoption(parser):
    parser.addoption("--target", default="spec")     # the suite plugin's option, which is off here
"""


def ran(result) -> set[str]:
    return {r.nodeid.split("::")[-1] for r in result.getreports("pytest_runtest_logreport") if r.when == "call"}


@pytest.mark.parametrize("args,runs,deselected", [
    ((), {"test_quick"}, 1),                               # the README's test command: quick by default
    (("--tier", "slow"), {"test_slow"}, 1),                # CI's second command
    (("--tier", "all"), {"test_quick", "test_slow"}, 0),
    (("test_tiers_two.py::test_slow",), {"test_slow"}, 0),  # named by id: whatever its tier
], ids=["quick", "slow", "all", "named-by-id"])
def test_each_tier_runs_its_tests_and_the_two_tiers_run_every_test_once(pytester, monkeypatch, args, runs,
                                                                       deselected):
    monkeypatch.delenv("DPEP_TIER", raising=False)
    pytester.makepyfile(test_tiers_two=TESTS)
    result = pytester.inline_run(*PLUGINS, *args)
    assert ran(result) == runs
    assert sum(len(c.items) for c in result.getcalls("pytest_deselected")) == deselected


def test_a_run_against_another_target_than_the_spec_runs_every_test_unless_told(pytester, monkeypatch):
    """The property suite against an engine (CI's `--target sglang`, the README's `--target mypkg.mod:T`) keeps
    every case: the tiers are for this repository's own test command."""
    monkeypatch.delenv("DPEP_TIER", raising=False)
    pytester.makepyfile(test_tiers_two=TESTS)
    pytester.makeconftest(TARGET_OPTION)
    assert ran(pytester.inline_run(*PLUGINS, "--target", "sglang")) == {"test_quick", "test_slow"}
    assert ran(pytester.inline_run(*PLUGINS, "--target", "spec")) == {"test_quick"}
    assert ran(pytester.inline_run(*PLUGINS, "--target", "sglang", "--tier", "quick")) == {"test_quick"}


def test_the_environment_chooses_the_tier_and_a_bad_tier_is_a_usage_error(pytester, monkeypatch):
    pytester.makepyfile(test_tiers_two=TESTS)
    monkeypatch.setenv("DPEP_TIER", "slow")
    assert ran(pytester.inline_run(*PLUGINS)) == {"test_slow"}
    result = pytester.runpytest(*PLUGINS, "--tier", "fast")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--tier*invalid choice*fast*"])
    monkeypatch.setenv("DPEP_TIER", "fast")
    result = pytester.runpytest(*PLUGINS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*DPEP_TIER='fast'*"])
