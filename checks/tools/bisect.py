"""Find the SGLang release where a verdict changes: the first bad release of a regression, or the first fixed
release of a bug, by binary search over the releases' cached environments (checks.targets.sglang.envs).

    dpep bisect --releases 0.5.21..0.5.23 --replay "dpep replay --target sglang --unit moe --fixture \\
        qwen3-moe-dense --layout tp1-dp1-ep1 --layer 0 --batch 'dp0:0+3 seed=1'"
    dpep bisect --releases 0.5.21..0.5.23 --pytest "property_tests/test_parity.py -k pinned --target sglang"

A query is a replay line (as a failure prints it; `dpep replay`, `python -m checks.tools.replay` or just its
options) or the arguments of a pytest run. A release's verdict is the query's exit code there: 0 PASS,
1 FAIL, anything else ERROR (a harness fault - the target's adapter does not fit the release, replay's exit 3 -,
a time-out: reported, never counted as either). `--property P`: a FAIL counts only when property P failed (a
second bug failing another property in some releases does not move the boundary); `--env NAME=VALUE`: the
runs' environment (a museum exhibit's). The search assumes one change in the range: a bug introduced and
fixed inside it reads "no boundary" at its two ends (the table shows them); bisect a range holding one. Both ends
of the range are tried first; when they agree there is no boundary in the range. Every verdict is kept in a
state file as soon as it is known (--state, default runs/bisect/<query digest>.json): an interrupted bisect
resumes where it stopped, and environments already built are reused.

Exit codes: 0 a boundary found, 1 none (no release fails, or every release fails), 2 bad input (unknown
release, a range holding no supported release, a replay line that does not parse, a unit a release in the
range does not reach): refused before anything installs; 3 a release's environment could not be built or its
run ended in ERROR.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dpep_parity.checks.targets.sglang import envs, releases
from dpep_parity.progname import prog

PASS, FAIL, ERROR = "PASS", "FAIL", "ERROR"
_REPLAY_PREFIXES = (("dpep", "replay"), ("python", "-m", "checks.tools.replay"), ("python3", "-m", "checks.tools.replay"),
                    ("python", "-m", "dpep_parity.checks.tools.replay"))


class BadQuery(ValueError):
    pass


@dataclass(frozen=True)
class Query:
    kind: str                  # "replay" | "pytest"
    args: tuple[str, ...]      # the command's own arguments
    unit: str | None = None    # replay: the unit (checked against every release's adapter)

    def command(self, python: str) -> list[str]:
        if self.kind == "replay":
            return [python, "-m", "dpep_parity.checks.tools.replay", *self.args]
        return [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", *self.args]

    @property
    def text(self) -> str:
        return f"{self.kind}: {shlex.join(self.args)}"


def parse_replay(line: str) -> Query:
    """A replay line -> Query; BadQuery naming what does not parse (replay's own grammar and checks)."""
    from dpep_parity.checks.tools import replay
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise BadQuery(f"--replay does not parse: {e}") from None
    for pre in _REPLAY_PREFIXES:
        if tuple(words[: len(pre)]) == pre:
            words = words[len(pre):]
            break
    ap = replay.parser()
    ap.exit_on_error = False
    try:
        a = ap.parse_args(words)
    except (argparse.ArgumentError, SystemExit) as e:
        raise BadQuery(f"--replay does not parse as a replay line: {e}") from None
    bad = replay.problems(a)
    if bad:
        raise BadQuery("--replay: " + "; ".join(bad))
    return Query("replay", tuple(words), a.unit)


def _unit_problems(query: Query, rels: list[releases.Release]) -> list[str]:
    if query.unit is None:
        return []
    from dpep_parity.checks.targets.sglang import eras
    out = []
    for r in rels:
        ad = eras.adapter(r.version)
        if query.unit not in ad.units:
            out.append(f"sglang {r.version} does not reach unit {query.unit!r}: "
                       f"{ad.unreached.get(query.unit, 'no adapter step')}")
    return out


class State:
    """Verdicts per release, written through to a JSON file (resume)."""

    def __init__(self, path: Path, query: Query):
        self.path, self.query = path, query
        self.verdicts: dict[str, dict] = {}
        if path.is_file():
            data = json.loads(path.read_text())
            if data.get("query") == query.text:
                self.verdicts = data.get("verdicts", {})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"query": self.query.text, "verdicts": self.verdicts}, indent=1))
        os.replace(tmp, self.path)


def _verdict_of(rc: int) -> str:
    return PASS if rc == 0 else FAIL if rc == 1 else ERROR


def run_release(query: Query, version: str, timeout: float, log, env: dict | None = None) -> dict:
    """The query's verdict on one release (its environment built on demand)."""
    t0 = time.perf_counter()
    try:
        python = envs.python_for(version)
    except RuntimeError:
        envs.install(version, log=lambda m: log(f"    {m}"))
        python = envs.python_for(version)
    try:
        p = subprocess.run(query.command(python), capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **(env or {})})
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, f"timed out after {timeout:.0f} s\n{(e.stdout or b'')[-2000:]!r}", ""
    from dpep_parity.checks.tools.killtable import PROPERTIES
    out_lines = [ln for ln in out.splitlines() if ln.strip()]
    lines = out_lines + [ln for ln in err.splitlines() if ln.strip()]
    # the failed properties, as a replay's report names them ("[parity] ...", "[no-crash] ...")
    tagged = [(m.group(1), ln) for ln in lines if (m := re.match(r"\[([a-z-]+)\] ", ln)) and m.group(1) in PROPERTIES]
    failed = sorted({p for p, _ in tagged})
    # else the run's own last word (its verdict line on stdout), not an interpreter warning printed at exit
    last = out_lines or lines
    evidence = tagged[0][1] if tagged else (last[-1] if last else "")
    return {"verdict": _verdict_of(rc), "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "evidence": evidence[:300], "failed": failed}


def judged(got: dict, prop: str | None) -> str:
    """A release's verdict; with `prop`, a FAIL is a FAIL only when that property failed (another property's
    failure, e.g. a second bug in the same releases, reads PASS for this search)."""
    if prop and got["verdict"] == FAIL and prop not in got.get("failed", ()):
        return PASS
    return got["verdict"]


def bisect(query: Query, rels: list[releases.Release], state: State, timeout: float, log=print,
           prop: str | None = None, env: dict | None = None) -> dict:
    """Binary search for the first release whose verdict differs from the oldest one's. Returns a summary."""
    tried = 0

    def verdict(i: int) -> str:
        nonlocal tried
        v = rels[i].version
        tried += 1
        if v in state.verdicts:
            log(f"[{tried}] sglang {v}: {judged(state.verdicts[v], prop)} (from {state.path})")
        else:
            log(f"[{tried}] sglang {v}: running ...")
            state.verdicts[v] = run_release(query, v, timeout, log, env=env)
            state.save()
            r = state.verdicts[v]
            log(f"[{tried}] sglang {v}: {judged(r, prop)} in {r['seconds']} s  {r['evidence']}")
        return judged(state.verdicts[v], prop)

    lo, hi = 0, len(rels) - 1
    first, last = verdict(lo), verdict(hi) if hi > lo else None
    if ERROR in (first, last):
        return {"found": False, "error": True}
    if last is None or first == last:
        return {"found": False, "error": False, "all": first}
    while hi - lo > 1:                   # invariant: verdict(lo) == first != verdict(hi)
        mid = (lo + hi) // 2
        v = verdict(mid)
        if v == ERROR:
            return {"found": False, "error": True}
        lo, hi = (mid, hi) if v == first else (lo, mid)
    return {"found": True, "error": False, "before": rels[lo].version, "at": rels[hi].version,
            "kind": "first bad release" if first == PASS else "first fixed release"}


def table(rels: list[releases.Release], state: State, prop: str | None = None) -> str:
    rows = ["| release | date | verdict | failed | seconds | evidence |", "|---|---|---|---|---|---|"]
    for r in rels:
        v = state.verdicts.get(r.version)
        if v:
            rows.append(f"| {r.version} | {r.date} | {judged(v, prop)} | {', '.join(v.get('failed', ()))} | "
                        f"{v['seconds']} | {v['evidence'].replace('|', '/')} |")
        else:
            rows.append(f"| {r.version} | {r.date} | (not tried) | | |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.bisect"), description=__doc__.split("\n\n")[0],
                                 epilog="Exit: 0 boundary found, 1 none, 2 bad input, 3 environment or run error.")
    ap.add_argument("--releases", required=True, help="a range of releases, e.g. 0.5.21..0.5.23")
    q = ap.add_mutually_exclusive_group(required=True)
    q.add_argument("--replay", help="a replay line (dpep replay ... / python -m checks.tools.replay ... / its options)")
    q.add_argument("--pytest", help="pytest arguments, e.g. \"property_tests -k pinned --target sglang\"")
    ap.add_argument("--property", default=None, dest="prop",
                    help="a release FAILs only when this property fails (e.g. no-crash, parity): another "
                         "property's failure reads PASS")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable of every release's run (repeatable), e.g. "
                         "DPEP_SGLANG_WORKAROUNDS=off")
    ap.add_argument("--state", default=None, help="the state file (default runs/bisect/<query digest>.json)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one release's run may take")
    a = ap.parse_args(argv)
    try:
        rels = releases.parse_range(a.releases)
        query = parse_replay(a.replay) if a.replay else Query("pytest", tuple(shlex.split(a.pytest)))
        bad = _unit_problems(query, rels)
        from dpep_parity.checks.tools.killtable import PROPERTIES
        if a.prop is not None and a.prop not in PROPERTIES:
            bad.append(f"--property {a.prop!r} is not a property; known: {', '.join(PROPERTIES)}")
        bad += [f"--env {e!r} is not NAME=VALUE" for e in a.env if not re.fullmatch(r"[A-Za-z_]\w*=.*", e)]
        if bad:
            raise BadQuery("\n  ".join(bad))
    except (releases.UnknownRelease, BadQuery, ValueError) as e:
        ap.error(str(e))
    env = dict(e.split("=", 1) for e in a.env)
    digest = hashlib.sha1(f"{a.releases} {query.text} {a.prop} {sorted(env.items())}".encode()).hexdigest()[:12]
    state = State(Path(a.state or Path("runs") / "bisect" / f"{digest}.json"), query)
    print(f"bisect over {len(rels)} releases ({rels[0].version} .. {rels[-1].version}); {query.text}"
          + (f"; FAIL = property {a.prop} fails" if a.prop else "") + "".join(f"; {k}={v}" for k, v in env.items()))
    print(f"state: {state.path}")
    try:
        res = bisect(query, rels, state, a.timeout, prop=a.prop, env=env)
    except RuntimeError as e:          # an environment that could not be built
        print(f"error: {e}", file=sys.stderr)
        return 3
    print()
    print(table(rels, state, a.prop))
    print()
    if res["error"]:
        print("ERROR: a release's run neither passed nor failed (see its evidence); no verdict")
        return 3
    if not res["found"]:
        print("no boundary: " + ("every release tried passes" if res["all"] == PASS else
                                 "every release tried fails (the change is older than the range)"))
        return 1
    print(f"{res['kind']}: sglang {res['at']} (the release before it, {res['before']}, is the other way)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
