"""The kill table: run the property suite against every mutant of the catalog and the unmutated spec.

    python -m checks.killtable [--jobs 2] [--only B14,B15] [--out reports] [--check] [-- PYTEST ARGS]

Each mutant gets its own pytest process (`--target checks.mutants:ID -x`), so a hang or crash in one
cannot touch another; the table says which property killed it, with the failure's first lines and the
time to kill. Written to reports/kill-table.{json,md}; with --check, exits 1 unless every mutant is killed
and the spec passes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from checks.mutants import CATALOG, NOT_EXPRESSED

ROOT = Path(__file__).resolve().parent.parent


def run_suite(target: str, extra: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "property_tests/test_parity.py", "-x", "-q", "-p", "no:cacheprovider",
               "-p", "no:randomly", f"--target={target}", f"--junitxml={xml}", *extra]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = -9, f"suite exceeded {timeout_s:.0f}s: {(e.stdout or b'')[-2000:]!r}"
        seconds = time.perf_counter() - t0
        test, message = None, ""
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                fail = case.find("failure") if case.find("failure") is not None else case.find("error")
                if fail is not None:
                    test = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
                    message = (fail.get("message") or "") + "\n" + (fail.text or "")
                    break
    return {"target": target, "rc": rc, "seconds": round(seconds, 1), "test": test,
            "property": _property(message), "message": _excerpt(message) if test else _excerpt(out)}


def _property(message: str) -> str | None:
    m = re.search(r"^\s*(?:E\s+)?(?:AssertionError: )?.*?\[([a-z][\w-]*)\]", message, re.M)
    return m.group(1) if m else None


def _excerpt(text: str, lines: int = 4) -> str:
    keep = [l.strip() for l in text.splitlines() if l.strip().startswith(("[", "HANG", "MISMATCH", "DEADLOCK", "-"))
            or "FAIL" in l or "rows beyond" in l or "bias" in l]
    return "\n".join(keep[:lines]) or "\n".join(text.strip().splitlines()[-lines:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checks.killtable", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--out", default=str(ROOT / "reports"))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per suite run")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every mutant dies and spec passes")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args(argv)
    ids = [i for i in (a.only.split(",") if a.only else CATALOG) if i]
    unknown = [i for i in ids if i not in CATALOG]
    if unknown:
        ap.error(f"unknown mutant ids {unknown}; known: {', '.join(CATALOG)}")
    targets = ["spec"] + [f"checks.mutants:{i}" for i in ids]
    print(f"kill table: {len(ids)} mutants + spec, {a.jobs} at a time", flush=True)
    rows = {}
    with ThreadPoolExecutor(a.jobs) as pool:
        futs = {pool.submit(run_suite, t, a.pytest_args, a.timeout): t for t in targets}
        for f in futs:
            r = f.result()
            rows[futs[f]] = r
            name = futs[f].split(":")[-1]
            state = ("PASS" if r["rc"] == 0 else "FAIL") if name == "spec" else \
                ("killed" if r["rc"] not in (0, 5) else "SURVIVED")
            print(f"  {name:5s} {state:8s} {r['seconds']:6.1f}s  {r['property'] or '-':12s} {r['test'] or ''}",
                  flush=True)
    table = build_table(rows, ids)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kill-table.json").write_text(json.dumps(table, indent=2))
    (out / "kill-table.md").write_text(to_markdown(table))
    print(to_markdown(table))
    ok = table["spec_passed"] and table["killed"] == table["expressible"]
    return 0 if ok or not a.check else 1


def build_table(rows: dict, ids: list[str]) -> dict:
    muts = []
    for i in ids:
        m, r = CATALOG[i], rows[f"checks.mutants:{i}"]
        muts.append({"id": i, "name": m.name, "kind": m.kind, "mechanism": m.mechanism,
                     "killed": r["rc"] not in (0, 5), "property": r["property"], "test": r["test"],
                     "seconds": r["seconds"], "message": r["message"]})
    spec = rows["spec"]
    killed = sum(m["killed"] for m in muts)
    return {"summary": f"spec {'passes' if spec['rc'] == 0 else 'FAILS'}; {killed} of {len(muts)} mutants killed",
            "spec_passed": spec["rc"] == 0, "spec_seconds": spec["seconds"], "spec_message": spec["message"],
            "expressible": len(muts), "killed": sum(m["killed"] for m in muts), "mutants": muts,
            "not_expressed": NOT_EXPRESSED}


def to_markdown(t: dict) -> str:
    lines = ["# Kill table\n", f"spec (unmutated): {'PASS' if t['spec_passed'] else 'FAIL'} "
             f"({t['spec_seconds']} s); mutants killed: {t['killed']} / {t['expressible']}\n",
             "| id | mutant | kind | killed | by property | test | time (s) | first lines |",
             "|---|---|---|---|---|---|---|---|"]
    for m in t["mutants"]:
        msg = m["message"].replace("|", "\\|").replace("\n", "<br>")[:300]
        lines.append(f"| {m['id']} | {m['name']} | {m['kind']} | {'yes' if m['killed'] else '**NO**'} | "
                     f"{m['property'] or '-'} | {m['test'] or '-'} | {m['seconds']} | {msg} |")
    lines.append("\nNot expressed by a layer-level run of the spec:\n")
    lines += [f"- {k}: {v}" for k, v in t["not_expressed"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
