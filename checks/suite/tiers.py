"""The repository's own test tiers (loaded by the root conftest.py only, never by the `dpep` plugin that engines'
repositories load): `--tier quick` (the default, the README's test command), `--tier slow`, `--tier all`.

A test marked `slow` runs a whole sub-run on its own (a gate simulation of hundreds of sign-offs, an end-to-end
sign-off of several served configurations, a kill-table or pytest run in a subprocess, a wheel build, torchrun
agents, a property search that must find a planted fault, SGLang's broken steps), 9 s or more on 2 cores
(docs/harness.md, "Tiers"). The quick tier deselects them and CI runs both tiers (.ci/run), so CI's collected test
ids are the whole set: a tier moves a test in time, never out of CI. A run that names tests by node id
(`path::name`) runs them whatever their tier, and so does `--tier all`.

Written here rather than taken from a plugin: `-m "not slow"` in addopts would be replaced by any `-m` a user
types, and the pytest documentation's `--runslow` recipe skips (not deselects) and has no way to run only the
slow tier, which CI's second command needs.
"""
from __future__ import annotations

import os

import pytest

TIERS = ("quick", "slow", "all")


def pytest_addoption(parser):
    parser.getgroup("dpep").addoption(
        "--tier", default=None, choices=TIERS,
        help="the repository's tests to run: quick (tests not marked slow; the default on the spec target), slow "
             "(only those), all (the default on any other target); also DPEP_TIER")


def tier_of(config) -> str:
    """--tier, else DPEP_TIER, else quick on the spec target and all on any other."""
    chosen = config.getoption("--tier") or os.environ.get("DPEP_TIER")
    if chosen:
        return chosen
    return "quick" if config.getoption("--target", default="spec") == "spec" else "all"


def pytest_configure(config):
    if os.environ.get("DPEP_TIER") and os.environ["DPEP_TIER"] not in TIERS:
        raise pytest.UsageError(f"DPEP_TIER={os.environ['DPEP_TIER']!r}: one of {', '.join(TIERS)}")
    config.addinivalue_line("markers", "slow: a whole sub-run, 9 s or more on 2 cores; deselected by --tier quick "
                                       "(the default), run by --tier slow|all (CI runs both tiers)")


def pytest_report_header(config):
    tier = tier_of(config)
    if named_by_id(config):
        return [f"dpep tier: {tier}, ignored: tests named by node id run whatever their tier"]
    what = {"quick": "tests marked slow deselected (--tier slow runs them, --tier all everything; CI runs both)",
            "slow": "only tests marked slow", "all": "every test"}[tier]
    return [f"dpep tier: {tier}: {what}"]


def named_by_id(config) -> bool:
    return any("::" in str(a) for a in config.args)


def pytest_collection_modifyitems(config, items):
    tier = tier_of(config)
    if tier == "all" or named_by_id(config):
        return
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") is not None
        (keep if slow == (tier == "slow") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
