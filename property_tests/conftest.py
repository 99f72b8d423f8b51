from __future__ import annotations

import dataclasses

import pytest

from dpep_parity.checks.suite.suite_options import SuiteOptions
from dpep_parity.checks.targets.protocol import left_out_fixtures


@pytest.fixture(scope="session")
def suite(pytestconfig) -> SuiteOptions:
    """The suite's options as the plugin parsed them (checks.suite.suite_options.parse), with --device auto
    resolved and the fixtures of families the target declares it lacks left out (a skip when none is left)."""
    opts: SuiteOptions = pytestconfig.dpep_suite
    device = opts.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    left_out = left_out_fixtures(opts.target, opts.fixtures)
    if left_out and len(left_out) == len(opts.fixtures):
        pytest.skip("; ".join(f"{f}: {why}" for f, why in left_out))
    return dataclasses.replace(opts, fixtures=tuple(f for f in opts.fixtures if f not in dict(left_out)),
                               device=device, left_out=left_out)
