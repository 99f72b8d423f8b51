"""The checkout's import graph as a static reader sees it (grimp: pip install -e '.[dev]'), for
docs/architecture.md: modules, imports, the floors (a module's floor is the longest chain of imports below
it: floor 0 imports nothing of ours), and the imports between areas.

    python scripts/import_graph.py [--areas] [--modules]

Exit 1 if the graph has a circle (checks/tests/test_architecture.py asserts the same, and that every
internal import resolves).
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections import Counter, defaultdict

import grimp

AREAS = (   # longest prefix first: the area a module belongs to
    ("dpep_parity.checks.targets.sglang", "checks.targets.sglang"),
    ("dpep_parity.checks.targets", "checks.targets"),
    ("dpep_parity.checks.units", "checks.units"),
    ("dpep_parity.checks.serving", "checks.serving"),
    ("dpep_parity.checks.tests", "checks.tests"),
    ("dpep_parity.checks.core", "checks.core"),
    ("dpep_parity.checks.harness", "checks.harness"),
    ("dpep_parity.checks.oracle", "checks.oracle"),
    ("dpep_parity.checks.judge", "checks.judge"),
    ("dpep_parity.checks.catalog", "checks.catalog"),
    ("dpep_parity.checks.suite", "checks.suite"),
    ("dpep_parity.checks.tools", "checks.tools"),
    ("dpep_parity.checks", "checks"),
    ("dpep_parity.evals.engines", "evals.engines"),
    ("dpep_parity.evals.tasks", "evals.tasks"),
    ("dpep_parity.evals.tests", "evals.tests"),
    ("dpep_parity.evals", "evals"),
    ("dpep_parity.fixtures.families", "fixtures.families"),
    ("dpep_parity.fixtures.tests", "fixtures.tests"),
    ("dpep_parity.fixtures", "fixtures"),
    ("dpep_parity.property_tests", "property_tests"),
    ("dpep_parity", "dpep_parity"),
)


def area(module: str) -> str:
    return next(a for prefix, a in AREAS if module == prefix or module.startswith(prefix + "."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--areas", action="store_true", help="imports between areas")
    ap.add_argument("--modules", action="store_true", help="every module with its floor")
    a = ap.parse_args(argv)
    g = grimp.build_graph("dpep_parity", include_external_packages=False, cache_dir=None)
    below = {m: g.find_modules_directly_imported_by(m) for m in g.modules}
    edges = sum(len(v) for v in below.values())

    @functools.cache
    def floor(m: str, path: tuple = ()) -> int:
        if m in path:
            raise SystemExit(f"circle: {' -> '.join((*path, m))}")
        return 1 + max((floor(n, (*path, m)) for n in below[m]), default=-1)

    sys.setrecursionlimit(10_000)
    floors = {m: floor(m) for m in g.modules}
    print(f"{len(g.modules)} modules, {edges} imports between them, floors 0-{max(floors.values())}, no circle")
    by_area: dict[str, list[str]] = defaultdict(list)
    for m in g.modules:
        by_area[area(m)].append(m)
    print("\n| area | modules | floors |\n|---|---:|---|")
    for _, name in sorted(AREAS, key=lambda x: min((floors[m] for m in by_area[x[1]]), default=99)):
        ms = by_area.get(name)
        if ms:
            fl = sorted(floors[m] for m in ms)
            print(f"| {name} | {len(ms)} | {fl[0]}-{fl[-1]} |")
    if a.areas:
        pairs = Counter((area(m), area(n)) for m in g.modules for n in below[m] if area(m) != area(n))
        print("\n| from | to | imports |\n|---|---|---:|")
        for (x, y), k in sorted(pairs.items()):
            print(f"| {x} | {y} | {k} |")
    if a.modules:
        for m in sorted(g.modules, key=lambda m: (floors[m], m)):
            print(f"{floors[m]:3d} {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
