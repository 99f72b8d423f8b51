from __future__ import annotations

from dataclasses import dataclass

import pytest

from dpep_parity.checks.targets.protocol import left_out_fixtures
from dpep_parity.fixtures.specs import DEFAULT_SUITE, FIXTURES


@dataclass(frozen=True)
class SuiteOptions:
    target: str
    world_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    fixtures: tuple[str, ...]          # the requested fixtures of the families the target implements
    device: str
    deadline: float
    left_out: tuple[tuple[str, str], ...] = ()   # (fixture, why): a family the target declares it lacks


@pytest.fixture(scope="session")
def suite(pytestconfig) -> SuiteOptions:
    fx = tuple(f for f in pytestconfig.getoption("--models").split(",") if f) or DEFAULT_SUITE
    unknown = [f for f in fx if f not in FIXTURES]
    if unknown:
        raise pytest.UsageError(f"unknown fixtures {unknown}; known: {sorted(FIXTURES)}")
    device = pytestconfig.getoption("--device")
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = pytestconfig.getoption("--target")
    left_out = left_out_fixtures(target, fx)
    if left_out and len(left_out) == len(fx):
        pytest.skip("; ".join(f"{f}: {why}" for f, why in left_out))
    return SuiteOptions(
        target=target,
        world_sizes=tuple(int(w) for w in pytestconfig.getoption("--world-sizes").split(",")),
        dtypes=tuple(pytestconfig.getoption("--dtypes").split(",")),
        fixtures=tuple(f for f in fx if f not in dict(left_out)), device=device,
        deadline=pytestconfig.getoption("--deadline"), left_out=left_out)

