"""The kill table: run the property suite against every mutant of the catalog (or your own targets) and an
unmutated control, and say who caught what.

    python -m checks.tools.killtable [--jobs 2] [--only B14,B15] [--target pkg.mod:OBJ ...] [--control spec]
                               [--dtypes bfloat16] [--out reports] [--check] [-- PYTEST ARGS]

Each target gets its own pytest process (checks.tools.forked_pytest: forked from one that imported the heavy
libraries once; `--target ... -x` on property_tests/test_parity.py and
test_stateful.py, hypothesis profile `kill`: ci without shrinking, unless DPEP_PROFILE says otherwise), so a
hang or crash in one cannot touch another.
A kill is a property of the suite failing: a failed check of checks.judge.parity (parity, ownership, routing,
dispatch, padding-rule, collectives, greedy, or liveness: a diagnosed hang / a rank that raised). Anything
else is not a kill and has its own verdict: ERROR (a collection, usage or import error, a test that crashed
without a property failing), TIMEOUT (the suite run exceeded --timeout), SURVIVED. Each catalog mutant
declares the properties that should catch it (checks.catalog.mutants, `kills=`); a kill by another property is
flagged "killed-elsewhere": the bug was seen, but not where its mechanism says it should be, so either the
declaration or a property is wrong. Outside targets may declare `expected_kills` (a tuple of property
names); without it any property kill counts.

With --target the catalog is not run (unless --only names some of it): users check their own mutants. The
control (default: the spec; with --control, e.g. your unmutated engine) must pass. Written to
reports/kill-table.{json,md}; exits 1 unless the control passes and every target is killed by an expected
property (with or without --check, which old scripts pass).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dpep_parity.checks.catalog.mutants import CATALOG, NOT_EXPRESSED
from dpep_parity.checks.core.batches import DTYPES
from dpep_parity.checks.core.records import REPORT_KEY, FailureRecord, RecordError
from dpep_parity.checks.tools import forked_pytest
from dpep_parity.progname import prog

ROOT = Path(__file__).resolve().parents[2]
# the checks a result of checks.judge.parity carries (Check.prop), in its failure records (checks.core.records)
PROPERTIES = ("parity", "ownership", "routing", "router", "dispatch", "padding-rule", "collectives", "greedy", "liveness",
              "no-crash", "precision")
# the single-forward properties first (pinned triggers, then the search), then sequences of forwards on one build
SUITE = ("property_tests/test_parity.py", "property_tests/test_precision.py", "property_tests/test_stateful.py")
PYTEST_EXIT = {2: "interrupted or collection error", 3: "pytest internal error", 4: "usage error",
               5: "no test collected"}


def run_suite(target: str, extra: list[str], timeout_s: float) -> dict:
    """One pytest run of the property suite on `target`: exit code, time, and its failing test cases."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        args = [*SUITE, "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", f"--target={target}",
                f"--junitxml={xml}", *extra]
        env = {**os.environ, "DPEP_PROFILE": os.environ.get("DPEP_PROFILE") or "kill"}
        t0 = time.perf_counter()
        rc, out = forked_pytest.run(args, env, str(ROOT), os.path.join(tmp, "pytest.log"), timeout_s)
        seconds = time.perf_counter() - t0
        try:
            cases = junit_failures(xml) if os.path.exists(xml) else []
        except RecordError as e:      # a record of another version: refused, not guessed
            cases, out = [], f"{out}\nkill table: {e}"
    return {"target": target, "rc": rc, "seconds": round(seconds, 1), "cases": cases, "output": out[-4000:]}


def junit_failures(path: str) -> list[dict]:
    """Failing test cases of a junit file, in order: {"test", "kind": "failure" | "error", "message",
    "records"}: the failure records (checks.core.records) the suite's plugin put on the case's <properties>."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                records = [FailureRecord.from_json(p.get("value", ""))
                           for p in case.iter("property") if p.get("name") == REPORT_KEY]
                out.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "kind": kind,
                            "message": (el.get("message") or "") + "\n" + (el.text or ""), "records": records})
                break
    return out


def properties_of(case: dict) -> list[str]:
    """The suite's failed properties a case's records name, in order (a property the suite does not know is
    not a kill)."""
    found = [p for r in case.get("records", ()) for p in r.properties]
    return list(dict.fromkeys(p for p in found if p in PROPERTIES))


def classify(run: dict, expected: tuple[str, ...] = ()) -> dict:
    """The verdict of one mutant's run: killed / killed-elsewhere / SURVIVED / ERROR / TIMEOUT, the
    properties that failed, the test, and the first lines of the evidence."""
    rc, cases = run["rc"], run["cases"]
    base = {"rc": rc, "seconds": run["seconds"], "test": None, "properties": [], "message": ""}
    if rc is None:
        return {**base, "verdict": "TIMEOUT", "message": _excerpt(run["output"])}
    if rc == 0:
        return {**base, "verdict": "SURVIVED"}
    failed = [c for c in cases if c["kind"] == "failure" and properties_of(c)]
    if rc != 1 or not failed:
        why = PYTEST_EXIT.get(rc, f"pytest exit {rc}")
        first = cases[0] if cases else None
        text = first["message"] if first else run["output"]
        return {**base, "verdict": "ERROR", "test": first["test"] if first else None,
                "message": f"not a kill ({why}{', ' + first['kind'] + ' without a failed property' if first else ''}): "
                           + _excerpt(text)}
    case = failed[0]
    props = properties_of(case)
    ok = not expected or any(p in expected for p in props)
    return {**base, "verdict": "killed" if ok else "killed-elsewhere", "test": case["test"], "properties": props,
            "message": _excerpt(case["message"])}


def _excerpt(text: str, lines: int = 4) -> str:
    # without pytest's "E   " and the assertion's class name
    bare = (l.strip().removeprefix("E").strip().removeprefix("AssertionError: ") for l in text.splitlines())
    keep = [l for l in bare if (l.startswith(("[", "HANG", "MISMATCH", "DEADLOCK", "-"))
            or "FAIL" in l or "rows beyond" in l or "bias" in l) and not l.startswith("[+")]
    return "\n".join(keep[:lines]) or "\n".join(text.strip().splitlines()[-lines:])


def expectation(target: str) -> tuple[str, ...]:
    """The properties a target declares should kill it (`expected_kills`); () when it declares none or
    cannot be loaded (its run then reports the load error)."""
    from dpep_parity.checks.targets.protocol import resolve
    try:
        return tuple(getattr(resolve(target), "expected_kills", ()) or ())
    except ValueError:
        return ()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("python -m checks.tools.killtable"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated catalog mutant ids")
    ap.add_argument("--target", action="append", default=[], metavar="PKG.MOD:OBJ",
                    help="an outside target to run instead of the catalog (repeatable)")
    ap.add_argument("--control", default="spec", help="the unmutated target that must pass (default: spec)")
    ap.add_argument("--out", default="reports", help="folder for kill-table.{md,json} (default: reports/ here)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per suite run")
    ap.add_argument("--check", action="store_true",
                    help="kept for old scripts: the exit code is always 1 unless every target is killed by an "
                         "expected property and the control passes")
    ap.add_argument("--dtypes", default="", metavar="D1,D2",
                    help="the suite's dtypes for every run (default: the suite's own, float32,bfloat16); "
                         "bfloat16 alone for the precision habits that only a half-precision run can show")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args(argv)
    if a.dtypes:
        bad = [d for d in a.dtypes.split(",") if d not in DTYPES]
        if bad:
            ap.error(f"--dtypes: unknown {bad}; known: {', '.join(sorted(DTYPES))}")
        a.pytest_args = [f"--dtypes={a.dtypes}", *a.pytest_args]
    ids = [i for i in (a.only.split(",") if a.only else ([] if a.target else CATALOG)) if i]
    unknown = [i for i in ids if i not in CATALOG]
    if unknown:
        ap.error(f"unknown mutant ids {unknown}; known: {', '.join(CATALOG)}")
    if a.jobs < 1 or a.timeout <= 0:
        ap.error("--jobs and --timeout must be positive")
    rows = {f"checks.catalog.mutants:{i}": {"id": i, "name": CATALOG[i].name, "kind": CATALOG[i].kind,
                                    "mechanism": CATALOG[i].mechanism, "expected": list(CATALOG[i].kills)}
            for i in ids}
    for t in a.target:
        rows[t] = {"id": t, "name": t, "kind": "outside target", "mechanism": "", "expected": list(expectation(t))}
    print(f"kill table: {len(rows)} target(s) + control {a.control}, {a.jobs} at a time", flush=True)
    runs, verdicts = {}, {}
    with ThreadPoolExecutor(a.jobs) as pool:
        futs = {pool.submit(run_suite, t, a.pytest_args, a.timeout): t for t in [a.control, *rows]}
        try:
            for f in futs:
                t, r = futs[f], f.result()
                runs[t] = r
                if t == a.control:
                    print(f"  control {t}: {'PASS' if r['rc'] == 0 else 'FAIL'} {r['seconds']:6.1f}s", flush=True)
                else:
                    v = verdicts[t] = classify(r, tuple(rows[t]["expected"]))
                    print(f"  {rows[t]['id']:5s} {v['verdict']:16s} {r['seconds']:6.1f}s  "
                          f"{','.join(v['properties']) or '-':16s} {v['test'] or ''}", flush=True)
        except KeyboardInterrupt:     # the runs lead process groups of their own: Ctrl-C reaches only this one
            for f in futs:
                f.cancel()
            forked_pytest.interrupt()
            raise
    table = build_table(rows, verdicts, runs[a.control], a.control)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kill-table.json").write_text(json.dumps(table, indent=2))
    (out / "kill-table.md").write_text(to_markdown(table))
    print(to_markdown(table))
    ok = table["control_passed"] and table["killed"] == table["targets"]
    return 0 if ok else 1


def build_table(rows: dict, verdicts: dict, c: dict, control: str) -> dict:
    """`verdicts`: classify()'s answer per target; `c`: the control's run."""
    muts = [{**meta, **verdicts[t]} for t, meta in rows.items()]
    count = {v: sum(m["verdict"] == v for m in muts) for v in ("killed", "killed-elsewhere", "SURVIVED", "ERROR",
                                                               "TIMEOUT")}
    control_state = "passes" if c["rc"] == 0 else ("FAILS" if c["rc"] == 1 else
                                                   f"ERROR ({PYTEST_EXIT.get(c['rc'], c['rc'])})")
    summary = (f"control {control} {control_state}; {count['killed']} of {len(muts)} targets killed by an expected "
               f"property" + "".join(f", {n} {v}" for v, n in count.items() if v != "killed" and n))
    return {"summary": summary, "control": control, "control_passed": c["rc"] == 0, "control_seconds": c["seconds"],
            "control_message": "" if c["rc"] == 0 else _excerpt(c["cases"][0]["message"] if c["cases"] else c["output"]),
            "targets": len(muts), **{k.lower().replace("-", "_"): n for k, n in count.items()}, "mutants": muts,
            "not_expressed": NOT_EXPRESSED}


def to_markdown(t: dict) -> str:
    lines = ["# Kill table\n", f"{t['summary']}\n", f"control {t['control']}: {t['control_seconds']} s"
             + (f"; {t['control_message']}" if t["control_message"] else "") + "\n",
             "| id | mutant | kind | verdict | failed properties | expected | test | time (s) | first lines |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in t["mutants"]:
        msg = m["message"].replace("|", "\\|").replace("\n", "<br>")[:300]
        verdict = m["verdict"] if m["verdict"] == "killed" else f"**{m['verdict']}**"
        lines.append(f"| {m['id']} | {m['name']} | {m['kind']} | {verdict} | {', '.join(m['properties']) or '-'} | "
                     f"{', '.join(m['expected']) or 'any'} | {m['test'] or '-'} | {m['seconds']} | {msg} |")
    lines.append("\nNot expressed by a layer-level run of the spec:\n")
    lines += [f"- {k}: {v}" for k, v in t["not_expressed"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
