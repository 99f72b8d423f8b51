"""The museum: DP-attention / TP / EP bugs that SGLang shipped, each reproduced (or not) on the releases that
shipped and fixed it. One module per bug in this package, defining ``EXHIBIT = Exhibit(...)``; docs/museum.md
is the table.

    python -m checks.targets.sglang.museum list
    python -m checks.targets.sglang.museum run [--ids F1 F2] [--releases 0.5.22,0.5.23]

Every exhibit states the releases from their own source (file:line in `evidence`) and one of three statuses:
- caught: `query` (a replay line or pytest arguments, the smallest failing example) FAILs on every release
  of `shipped` the target reaches and PASSes on `fixed` (where there is one and the target reaches it);
  `run` checks exactly that and exits 1 when a verdict differs from the record;
- miss: the suite cannot see it, and `why` says why (a CUDA graph, a kernel, a path the target does not run);
- pending: the bug is on a path the suite runs, but no release that shipped it is reachable yet (its era has
  no adapter: checks/targets/sglang/releases.py); `why` names what is missing.
Recall is caught / all exhibits: a miss or a pending exhibit counts against it, never leaves the figure.
"""
from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from dpep_parity.progname import prog

CAUGHT, MISS, PENDING = "caught", "miss", "pending"


@dataclass(frozen=True)
class Exhibit:
    id: str
    title: str
    upstream: tuple[str, ...]        # issue / pull-request numbers of sgl-project/sglang
    mechanism: str
    kind: str                        # what a user saw: wrong numbers | crash | hang | wasted work
    shipped: tuple[str, ...]         # releases whose source has the bug (checked in each)
    fixed: str | None                # the first release with the fix (None: not fixed in any known release)
    evidence: str                    # file:line in the shipped and the fixed release
    status: str                      # caught | miss | pending
    prop: str = ""                   # the property that catches it (caught), e.g. "parity", "no-crash": a FAIL
                                     # counts only when this property is among the failed checks
    clean_before: str | None = None  # the release before the first shipped one, checked: the query PASSes
                                     # there (the bug was introduced in shipped[0]; None: older or unknown)
    query: str = ""                  # caught: a replay line ("replay: ...") or pytest arguments ("pytest: ...")
    env: dict = field(default_factory=dict)   # environment variables of the query's run
    why: str = ""                    # miss / pending: the reason
    # a failed result the bug explains on the releases that shipped it (the property suite reports it as an
    # expected failure there: findings.explained); None: its trigger is outside the default suite
    explains: Callable[[Any, str], bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        assert self.status in (CAUGHT, MISS, PENDING), self.status
        assert (self.status == CAUGHT) == bool(self.query), f"{self.id}: a caught exhibit has a query, no other"
        assert self.status == CAUGHT or self.why, f"{self.id}: a {self.status} exhibit says why"


def span(first: str, last: str) -> tuple[str, ...]:
    """Every release from `first` to `last` that the release table knows (each one checked by `run`)."""
    from dpep_parity.checks.targets.sglang import releases
    return tuple(r.version for r in releases.between(first, last))


def _load() -> dict[str, Exhibit]:
    out = {}
    for m in sorted((m for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
                    key=lambda m: m.name):
        ex = importlib.import_module(f"{__name__}.{m.name}").EXHIBIT
        if ex.id in out:
            raise RuntimeError(f"museum: exhibit id {ex.id} twice")
        out[ex.id] = ex
    return out


EXHIBITS: dict[str, Exhibit] = _load()


def record(ex: Exhibit) -> dict:
    """The exhibit as data (its explanation predicate left out)."""
    return {f.name: getattr(ex, f.name) for f in fields(ex) if f.name != "explains"}


def explaining(result, fixture: str, release: str | None) -> Exhibit | None:
    """The exhibit whose bug, shipped in `release`, explains every failed check of `result` (on `fixture`)."""
    for ex in EXHIBITS.values():
        if ex.explains is not None and release in ex.shipped and ex.explains(result, fixture):
            return ex
    return None


def recall(exhibits=None) -> tuple[int, int]:
    ex = list((exhibits or EXHIBITS).values())
    return sum(e.status == CAUGHT for e in ex), len(ex)


def parsed_query(ex: Exhibit):
    """The exhibit's query as `dpep bisect` takes it (checks.tools.bisect.Query)."""
    import shlex

    from dpep_parity.checks.tools import bisect
    kind, _, rest = ex.query.partition(":")
    if kind == "replay":
        return bisect.parse_replay(rest)
    return bisect.Query("pytest", tuple(shlex.split(rest)))


def plan(ex: Exhibit, only: set[str] | None = None) -> list[tuple[str, str]]:
    """(release, expected verdict) pairs `run` checks: PASS on the clean release before it (where recorded),
    FAIL on each reachable shipped release, PASS on the fixed one when reachable."""
    from dpep_parity.checks.targets.sglang import releases
    reach = {r.version for r in releases.supported() if reaches(r.version, ex)}
    pairs = [(ex.clean_before, "PASS")] if ex.clean_before in reach else []
    pairs += [(v, "FAIL") for v in ex.shipped if v in reach]
    if ex.fixed and ex.fixed in reach:
        pairs.append((ex.fixed, "PASS"))
    return [(v, e) for v, e in pairs if only is None or v in only]


def reaches(version: str, ex: Exhibit) -> bool:
    """Whether the release's adapter runs the unit of the exhibit's replay query (a pytest query: any)."""
    from dpep_parity.checks.targets.sglang import eras
    unit = parsed_query(ex).unit
    return unit is None or unit in eras.adapter(version).units


def as_recorded(ex: Exhibit, want: str, got: dict) -> bool:
    """A FAIL is the exhibit's only when its property failed (another failure, a harness ERROR or a time-out
    is not the bug); a PASS is a PASS."""
    if want == "PASS":
        return got["verdict"] == "PASS"
    return got["verdict"] == "FAIL" and ex.prop in got.get("failed", ())


def run(ids: list[str], only: set[str] | None, out_dir: Path, timeout: float, log=print) -> int:
    from dpep_parity.checks.tools import bisect
    rows, ok = [], True
    for i in ids:
        ex = EXHIBITS[i]
        if ex.status != CAUGHT:
            rows.append({"id": i, "status": ex.status, "why": ex.why})
            continue
        q = parsed_query(ex)
        for version, want in plan(ex, only):
            log(f"{i} on sglang {version}: expecting {want} ...")
            got = bisect.run_release(q, version, timeout, log, env=ex.env)
            good = as_recorded(ex, want, got)
            ok &= good
            log(f"{i} on sglang {version}: {got['verdict']} ({'as recorded' if good else 'NOT AS RECORDED'}) "
                f"in {got['seconds']} s  {got['evidence']}")
            rows.append({"id": i, "status": ex.status, "release": version, "expected": want, **got})
    out_dir.mkdir(parents=True, exist_ok=True)
    caught, total = recall()
    (out_dir / "museum.json").write_text(json.dumps({"recall": [caught, total], "runs": rows,
                                                     "exhibits": [record(e) for e in EXHIBITS.values()]},
                                                    indent=1))
    log(f"recall {caught}/{total}; report: {out_dir / 'museum.json'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.targets.sglang.museum"),
                                 description="SGLang's shipped DP-attention bugs on the releases that shipped "
                                             "them (docs/museum.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every exhibit: status, shipped / fixed releases")
    r = sub.add_parser("run", help="run the caught exhibits' queries on their shipped and fixed releases")
    r.add_argument("--ids", nargs="*", default=None, help="exhibit ids (default: all)")
    r.add_argument("--releases", default=None, help="only these releases, comma-separated")
    r.add_argument("--out", default="reports", help="folder of museum.json")
    r.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    if a.cmd == "list":
        caught, total = recall()
        for e in EXHIBITS.values():
            span = f"{e.shipped[0]}..{e.shipped[-1]}"
            print(f"{e.id:6} {e.status:8} shipped {span:28} fixed {e.fixed or '-':11} {e.title}")
        print(f"recall {caught}/{total}")
        return 0
    ids = a.ids or list(EXHIBITS)
    unknown = [i for i in ids if i not in EXHIBITS]
    if unknown:
        ap.error(f"unknown exhibit(s) {unknown}; known: {sorted(EXHIBITS)}")
    only = set(a.releases.split(",")) if a.releases else None
    if only:
        from dpep_parity.checks.targets.sglang import releases
        try:
            for v in only:
                if not releases.get(v).supported:
                    raise releases.UnknownRelease(f"sglang {v}: {releases.get(v).blocked}")
        except releases.UnknownRelease as e:
            ap.error(str(e))
    return run(ids, only, Path(a.out), a.timeout)


if __name__ == "__main__":
    sys.exit(main())
