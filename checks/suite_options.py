"""The property suite's command-line options, checked before any test is collected: a typo in a CI job must be
a usage error (pytest's exit code 4), never a green run that checked nothing (`--world-sizes 3` once gave
"1 skipped", exit 0) nor a failed test (the exit code of a parity failure).

`problems(...)` lists every broken rule at once; the pytest plugin (checks.pytest_plugin) raises them as one
pytest.UsageError.
"""
from __future__ import annotations

from dpep_parity.checks.batches import DTYPES
from dpep_parity.checks.topology import Layout, layout_violations, valid_layouts
from dpep_parity.fixtures.families import fixture_config
from dpep_parity.fixtures.specs import DEFAULT_SUITE, FIXTURES


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
