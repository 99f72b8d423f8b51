from __future__ import annotations

from dataclasses import dataclass

import pytest

from dpep_parity.fixtures.specs import DEFAULT_SUITE, FIXTURES


@dataclass(frozen=True)
class SuiteOptions:
    target: str
    world_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    fixtures: tuple[str, ...]
    device: str
    deadline: float


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
    return SuiteOptions(
        target=pytestconfig.getoption("--target"),
        world_sizes=tuple(int(w) for w in pytestconfig.getoption("--world-sizes").split(",")),
        dtypes=tuple(pytestconfig.getoption("--dtypes").split(",")),
        fixtures=fx, device=device, deadline=pytestconfig.getoption("--deadline"))
