"""Bad property-suite options are usage errors before anything runs (checks.suite.suite_options): each case names
its problem; end to end, pytest exits 4 (usage error) instead of passing green with everything skipped or
failing like a parity bug. Positive control: the default options, and other valid ones, have no problem."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpep_parity.checks.harness.torchrun_world import TorchrunOptions
from dpep_parity.checks.harness.world import WorldSettings
from dpep_parity.checks.suite.suite_options import problems

ROOT = Path(__file__).resolve().parents[2]
OK = dict(target="spec", world_sizes="1,2,4", dtypes="float32,bfloat16", models="", deadline=60.0)


@pytest.mark.parametrize("change, says", [
    ({"world_sizes": "0"}, "'0' is not a positive integer"),
    ({"world_sizes": "1,x"}, "'x' is not a positive integer"),
    ({"world_sizes": "3"}, "no valid layout of 3 ranks"),
    ({"world_sizes": ""}, "not a positive integer"),
    ({"dtypes": "float8"}, "--dtypes: unknown ['float8']"),
    ({"models": "qwen9-moe"}, "unknown fixtures ['qwen9-moe']"),
    ({"target": "nope.mod:X"}, "cannot load target 'nope.mod:X'"),
    ({"target": "nope"}, "expected 'package.module:object'"),
    ({"deadline": 0.0}, "--deadline must be positive"),
], ids=lambda x: str(x)[:40])
def test_each_bad_option_is_named(change, says):
    bad = problems(**{**OK, **change})
    assert len(bad) == 1 and says in bad[0], bad


def test_every_broken_option_is_reported_at_once():
    bad = problems("nope.mod:X", "3", "float8", "", 60.0)
    assert len(bad) == 3 and {b.split(":")[0] for b in bad} == {"--world-sizes", "--dtypes", "--target"}


@pytest.mark.parametrize("opts", [OK, {**OK, "world_sizes": "1,2,4,8", "dtypes": "float16",
                                       "models": "qwen3-moe,qwen2-moe-shared", "target": "checks.catalog.mutants:B14"}])
def test_valid_options_have_no_problem(opts):
    assert problems(**opts) == []


@pytest.mark.parametrize("args, says", [
    (["--world-sizes", "3"], "no valid layout of 3 ranks"),
    (["--dtypes", "float8", "--target", "nope.mod:X"], "cannot load target"),
    (["--world", "slurm"], "'slurm' is not a world kind"),
    (["--world", "torchrun", "--world-agents", "2", "--world-nproc", "2", "--world-sizes", "1,4"],
     "has 4 ranks; run with --world-sizes 4"),
])
@pytest.mark.slow
def test_pytest_exits_4_before_collecting(args, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "property_tests", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-2000:]
    assert says in out and "collected" not in out


@pytest.mark.parametrize("settings, says", [
    (WorldSettings("mpi"), "'mpi' is not a world kind"),
    (WorldSettings("torchrun", TorchrunOptions("localhost", 2, 2)), "'localhost' is not HOST:PORT"),
    (WorldSettings("torchrun", TorchrunOptions("127.0.0.1:0", 2, 0)), "need agents >= 0, nproc >= 1"),
    (WorldSettings("torchrun", TorchrunOptions("0.0.0.0:0", 0, 1)), "give --world-driver a fixed port"),
    (WorldSettings("torchrun", TorchrunOptions("127.0.0.1:0", 2, 2)), "has 4 ranks; run with --world-sizes 4"),
], ids=lambda x: str(x)[:48])
def test_each_bad_world_option_is_named(settings, says, monkeypatch):
    monkeypatch.setenv("DPEP_WORLD_KEY", "00" * 16)
    assert any(says in p for p in settings.problems([1, 2, 4])), settings.problems([1, 2, 4])


def test_hand_started_agents_need_the_shared_key(monkeypatch):
    monkeypatch.delenv("DPEP_WORLD_KEY", raising=False)
    bad = WorldSettings("torchrun", TorchrunOptions("0.0.0.0:29600")).problems([4])
    assert len(bad) == 1 and "set DPEP_WORLD_KEY" in bad[0]
    monkeypatch.setenv("DPEP_WORLD_KEY", "00" * 16)
    assert WorldSettings("torchrun", TorchrunOptions("0.0.0.0:29600")).problems([4]) == []
    assert WorldSettings("torchrun", TorchrunOptions("127.0.0.1:0", 2, 2)).problems([4]) == []
    assert WorldSettings().problems([1, 2, 4]) == []
