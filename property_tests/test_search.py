"""The search layer (property_tests/search.py, checks/suite/profiles.py): the floor on real examples, the targeting
signal, and one settings layer where DPEP_MAX_EXAMPLES always wins."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpep_parity.checks.core.batches import Batch
from dpep_parity.checks.core.batches import Request as R
from dpep_parity.checks.core.topology import Layout
from dpep_parity.checks.suite import profiles
from dpep_parity.property_tests import search
from dpep_parity.property_tests.strategies import Example

ROOT = Path(__file__).resolve().parent.parent
FEW = settings(max_examples=20, derandomize=True, database=None, suppress_health_check=list(profiles.SUPPRESSED))


def test_floor_fails_a_property_that_passed_on_too_few_real_examples():
    """Negative control: a property whose target skips 999 draws in 1000 used to pass green on the few
    hypothesis found before giving up; the floor fails it and names the reason."""
    @search.floor
    @FEW
    @given(st.integers(0, 10**6))
    def prop(n):
        if n % 1000:
            search.rejected("skipped: the target does not support this layout")
        search._tally[search.REAL] += 1
    with pytest.raises(AssertionError, match=r"(?s)fewer than half of max_examples=20.*x skipped: the target"):
        prop()


def test_floor_passes_a_property_with_enough_real_examples():
    """Positive control: a third of the draws rejected, the rest judged: hypothesis reaches max_examples."""
    @search.floor
    @FEW
    @given(st.integers(0, 10**6))
    def prop(n):
        if n % 3 == 0:
            search.rejected("skipped: odd layout")
        search._tally[search.REAL] += 1
    prop()


def test_judged_steers_the_search_by_the_error_to_bound_ratio(monkeypatch):
    seen = []
    monkeypatch.setattr(search, "target", lambda v, label: seen.append((label, v)))
    monkeypatch.setattr(search, "event", lambda e: None)
    ex = Example("qwen3-moe", Layout(2, 2, 2), Batch(((R(0, 3),), ()), 1), "bfloat16")
    search.judged("moe", ex, SimpleNamespace(verdict=SimpleNamespace(worst_excess=0.73)))
    search.judged("moe", ex, SimpleNamespace(verdict=None))          # a crash has no verdict: nothing to climb
    assert seen == [("moe: worst error / bound", 0.73)]


def test_health_checks_are_suppressed_one_by_one_with_a_reason():
    for name in profiles.PROFILES:
        assert set(settings.get_profile(name).suppress_health_check) == set(profiles.SUPPRESSED), name
    assert HealthCheck.data_too_large not in profiles.SUPPRESSED
    assert all(len(why) > 40 for why in profiles.SUPPRESSED.values())


def _header(*args, **env) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", "property_tests/test_strategies.py", "--co",
                          "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DPEP_PROFILE": "", **env})
    return out.stdout + out.stderr


@pytest.mark.parametrize("args,env,want", [
    (["--hypothesis-profile", "fuzz"], {"DPEP_MAX_EXAMPLES": "3"}, "profile=fuzz+max_examples=3 (max_examples=3)"),
    ([], {"DPEP_PROFILE": "release", "DPEP_MAX_EXAMPLES": "7"}, "profile=release+max_examples=7 (max_examples=7)"),
    (["--hypothesis-profile", "fuzz"], {}, "profile=fuzz (max_examples=500)"),
], ids=["cli-profile", "env-profile", "no-override"])
def test_max_examples_always_wins_and_the_real_profile_is_recorded(args, env, want):
    """Negative control: with --hypothesis-profile fuzz, DPEP_MAX_EXAMPLES=3 used to be dropped (500 examples
    ran) and the run was recorded as profile '_override'."""
    assert want in _header(*args, **env)
