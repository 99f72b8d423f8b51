"""Suite-wide options and hypothesis profiles.

Options: --target (spec, or package.module:object), --world-sizes, --dtypes, --fixtures, --device,
--deadline. Profiles: ci (derandomized, the default), dev, fuzz (random seeds, database kept), release;
choose with --hypothesis-profile or DPEP_PROFILE.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None, database=None,
                          print_blob=True, suppress_health_check=_SLOW)
settings.register_profile("dev", max_examples=30, deadline=None, print_blob=True, suppress_health_check=_SLOW)
settings.register_profile("fuzz", max_examples=500, deadline=None, print_blob=True, suppress_health_check=_SLOW,
                          database=DirectoryBasedExampleDatabase(".hypothesis/fuzz-examples"))
settings.register_profile("release", derandomize=True, max_examples=150, deadline=None, database=None,
                          print_blob=True, suppress_health_check=_SLOW)
settings.load_profile(os.environ.get("DPEP_PROFILE", "ci"))
if os.environ.get("DPEP_MAX_EXAMPLES"):   # e.g. a time-boxed fuzz run
    settings.register_profile("_override", settings(max_examples=int(os.environ["DPEP_MAX_EXAMPLES"])))
    settings.load_profile("_override")


def pytest_addoption(parser):
    g = parser.getgroup("dpep", "DP-attention / TP / EP parity suite")
    g.addoption("--target", default=os.environ.get("DPEP_TARGET", "spec"),
                help="system under test: 'spec' or package.module:object (docs/targets.md)")
    g.addoption("--world-sizes", default=os.environ.get("DPEP_WORLD_SIZES", "1,2,4"),
                help="comma-separated world sizes (ranks) to draw layouts from, e.g. 1,2,4,8")
    g.addoption("--dtypes", default=os.environ.get("DPEP_DTYPES", "float32,bfloat16"))
    g.addoption("--models", default=os.environ.get("DPEP_MODELS", ""),
                help="fixture models to draw from (default: all; see python -m fixtures list)")
    g.addoption("--device", default=os.environ.get("DPEP_DEVICE", "cpu"), choices=("cpu", "cuda", "auto"))
    g.addoption("--deadline", type=float, default=float(os.environ.get("DPEP_DEADLINE", "60")),
                help="seconds an example may take before its world is diagnosed and killed")


def pytest_configure(config):
    profile = config.getoption("--hypothesis-profile", default=None)
    if profile:
        settings.load_profile(profile)
    device = config.getoption("--device")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if device in ("cuda", "auto") and worker:
        from checks.gpus import assign_worker_gpus
        assign_worker_gpus(worker, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_report_header(config):
    return (f"dpep: target={config.getoption('--target')} device={config.getoption('--device')} "
            f"world sizes={config.getoption('--world-sizes')} dtypes={config.getoption('--dtypes')} "
            f"hypothesis profile={settings._current_profile}")
