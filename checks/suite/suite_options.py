"""The property suite's command-line options, checked before any test is collected: a typo in a CI job must be
a usage error (pytest's exit code 4), never a green run that checked nothing (`--world-sizes 3` once gave
"1 skipped", exit 0) nor a failed test (the exit code of a parity failure).

`parse(...)` reads them once per process (the pytest plugin, checks.suite.pytest_plugin, at configure time):
the options as a SuiteOptions, which the report header, the world set-up and the properties' `suite`
fixture read, and every broken rule at once, which the plugin raises as one pytest.UsageError.
"""
from __future__ import annotations

from dataclasses import dataclass

from dpep_parity.checks.core.batches import DTYPES
from dpep_parity.checks.core.topology import Layout, layout_violations, valid_layouts
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.fixtures.specs import DEFAULT_SUITE, FIXTURES


@dataclass(frozen=True)
class SuiteOptions:
    target: str
    world_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    fixtures: tuple[str, ...]          # the requested fixtures (the `suite` fixture keeps those of the families
    #                                    the target implements)
    device: str                        # cpu | cuda | auto (the `suite` fixture resolves auto)
    deadline: float
    left_out: tuple[tuple[str, str], ...] = ()   # (fixture, why): a family the target declares it lacks


def parse(target: str, world_sizes: str, dtypes: str, models: str, deadline: float,
          device: str = "cpu") -> tuple[SuiteOptions | None, list[str]]:
    """The suite's options read once: (the options, []) or (None, every broken rule)."""
    out = problems(target, world_sizes, dtypes, models, deadline)
    if out:
        return None, out
    fixtures = tuple(f for f in models.split(",") if f) or DEFAULT_SUITE
    return SuiteOptions(target, tuple(int(w) for w in world_sizes.split(",")),
                        tuple(d.strip() for d in dtypes.split(",")), fixtures, device, float(deadline)), []


def problems(target: str, world_sizes: str, dtypes: str, models: str, deadline: float) -> list[str]:
    out: list[str] = []
    fixtures = [f for f in models.split(",") if f] or list(DEFAULT_SUITE)
    unknown = [f for f in fixtures if f not in FIXTURES]
    if unknown:
        out.append(f"--models: unknown fixtures {unknown}; known: {sorted(FIXTURES)} (python -m fixtures list)")
    known = [f for f in fixtures if f in FIXTURES]

    sizes = []
    for w in (x.strip() for x in world_sizes.split(",")):
        if not w.isdigit() or int(w) < 1:
            out.append(f"--world-sizes: {w!r} is not a positive integer (e.g. --world-sizes 1,2,4)")
            continue
        sizes.append(int(w))
    if not sizes and not any(p.startswith("--world-sizes") for p in out):
        out.append("--world-sizes: no world size given (e.g. --world-sizes 1,2,4)")
    for w in sizes:
        if known and not any(valid_layouts(w, fixture_config(f)) for f in known):
            why = "; ".join(layout_violations(Layout(w, 1, 1), fixture_config(known[0])))
            out.append(f"--world-sizes: no valid layout of {w} ranks exists for {', '.join(known)} (e.g. "
                       f"tp={w} on {known[0]}: {why})")

    bad = [d for d in (x.strip() for x in dtypes.split(",")) if d not in DTYPES]
    if bad or not dtypes.strip():
        out.append(f"--dtypes: unknown {bad or [dtypes]}; known: {sorted(DTYPES)}")
    if not deadline > 0:
        out.append(f"--deadline must be positive seconds, got {deadline}")

    from dpep_parity.checks.targets.protocol import resolve
    try:
        resolve(target)
    except ValueError as e:
        out.append(f"--target: {e}")
    return out
